"""Tier 2: sampled speculative decoding reproduces the target's distribution (chi-square, fixed seeds).

Tolerance: a test fails when the chi-square p-value is below 1e-3. Seeds are fixed, so each run is
deterministic; the negative controls show the same test does reject a wrong sampler.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.methods import TreeShape
from specbench.models.tiny import tiny_model
from specbench.sampling.probs import draft_distribution, processed_probs, sample_sparse
from specbench.sampling.verify import verify
from specbench.types import DraftTree, SamplingParams

P_VALUE_FLOOR = 1e-3
VOCAB = 12
# Decoder layers of the tiny models the end-to-end draws run (1,500 generations a test): one, since what these
# tests check is the sampling rules over real caches, trees and rollbacks; caches of many layers are checked token
# for token by the greedy tests (3 layers, and SmolLM2's 30). One layer halves a draw (14.8 -> 7.7 ms).
SAMPLING_LAYERS = 1


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells expected below 5 counts into one."""
    expected = expected_probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token the target gives probability zero"
    counts, expected = counts[keep], expected[keep]
    return float(stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue)


def synthetic_case(seed, sampling):
    generator = torch.Generator().manual_seed(seed)
    target_logits = 2.0 * torch.randn(4, VOCAB, generator=generator)  # [rows, vocab]
    draft_logits = target_logits[0] + 1.5 * torch.randn(VOCAB, generator=generator)  # [vocab]
    return target_logits, draft_distribution(draft_logits, sampling)


SETTINGS = [SamplingParams(temperature=1.0, rule="rejection", draft_top_k=5),
            SamplingParams(temperature=0.7, top_k=6, rule="rejection", draft_top_k=4),
            SamplingParams(temperature=1.0, top_p=0.8, rule="rejection", draft_top_k=VOCAB),
            SamplingParams(temperature=1.0, rule="sample-match")]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"{s.rule}-t{s.temperature}-k{s.top_k}-p{s.top_p}")
@pytest.mark.parametrize("shape", ["chain", "siblings"])
def test_first_token_matches_target(sampling, shape):
    target_logits, draft_q = synthetic_case(7, sampling)
    generator = torch.Generator().manual_seed(11)
    counts = np.zeros(VOCAB)
    draws = 8_000
    for _ in range(draws):
        if shape == "chain":
            tokens = [sample_sparse(draft_q, generator) for _ in range(3)]
            tree = DraftTree.chain(tokens, [draft_q] * 3)
        else:  # three i.i.d. siblings under the root: recursive multi-draft rejection
            tokens = [sample_sparse(draft_q, generator) for _ in range(3)]
            tree = DraftTree(tuple(tokens), (-1, -1, -1), (draft_q,) * 3)
        path, bonus = verify(tree, target_logits, sampling, generator)
        counts[tree.tokens[path[0]] if path else bonus] += 1
    target_p = processed_probs(target_logits[:1], sampling)[0].double().numpy()
    assert chi_square_p(counts, target_p) > P_VALUE_FLOOR


def test_coupled_draws_are_exact_and_a_coupled_draft_lands_on_them():
    """sample-match's Gumbel-max draw (probs.coupled_draw) follows p, and a sparse q perturbed with the same
    noise (coupled_draw_sparse, one generator per draw as a position gives) proposes the target's token at
    least (1 - TV) / (1 + TV) of the time, far above the sum p*q that independent draws would reach."""
    from specbench.sampling.probs import coupled_draw, coupled_draw_sparse

    sampling = SamplingParams(temperature=1.0, rule="sample-match", draft_top_k=VOCAB)
    target_logits, draft_q = synthetic_case(7, sampling)
    target_p = processed_probs(target_logits[:1], sampling)[0].double()
    counts, agree, draws = np.zeros(VOCAB), 0, 8_000
    for seed in range(draws):
        token = coupled_draw(target_p, torch.Generator().manual_seed(seed))
        counts[token] += 1
        agree += coupled_draw_sparse(draft_q, torch.Generator().manual_seed(seed)) == token
    assert chi_square_p(counts, target_p.numpy()) > P_VALUE_FLOOR
    q = np.zeros(VOCAB)
    q[list(draft_q.ids)] = draft_q.probs
    p = target_p.numpy()
    distance = 0.5 * np.abs(p - q).sum()
    assert agree / draws >= (1 - distance) / (1 + distance) - 0.02
    assert agree / draws > float(p @ q) + 0.1, (agree / draws, float(p @ q))


def test_a_coupled_trees_children_are_draws_without_replacement_led_by_the_coupled_draw():
    """probs.coupled_top, a tree's children under sample-match: its leader is coupled_draw_sparse's token, and
    its first two follow q's draws without replacement (P(a, b) = q_a q_b / (1 - q_a), chi-square), so they hold
    the target's draw more often than the leader alone and more often than q's top two (which hold it with
    p's probability of those two)."""
    from specbench.sampling.probs import coupled_draw, coupled_draw_sparse, coupled_top

    sampling = SamplingParams(temperature=1.0, rule="sample-match", draft_top_k=5)
    target_logits, draft_q = synthetic_case(7, sampling)
    target_p = processed_probs(target_logits[:1], sampling)[0].double()
    q = dict(zip(draft_q.ids, draft_q.probs))
    pairs = [(a, b) for a in draft_q.ids for b in draft_q.ids if a != b]
    counts, led, held, draws = np.zeros(len(pairs)), 0, 0, 8_000
    for seed in range(draws):
        first, second = coupled_top(draft_q, torch.Generator().manual_seed(seed), 2)
        assert first == coupled_draw_sparse(draft_q, torch.Generator().manual_seed(seed))
        counts[pairs.index((first, second))] += 1
        token = coupled_draw(target_p, torch.Generator().manual_seed(seed))
        led += token == first
        held += token in (first, second)
    expected = np.array([q[a] * q[b] / (1 - q[a]) for a, b in pairs])
    assert chi_square_p(counts, expected) > P_VALUE_FLOOR
    top_two = float(target_p[list(draft_q.ids[:2])].sum())
    assert held / draws > led / draws + 0.02 and held / draws > top_two + 0.05, (held / draws, led / draws, top_two)


def test_negative_control_the_test_rejects_the_draft_distribution():
    """Emitting the draft's own samples (no verification) must fail the same test."""
    sampling = SETTINGS[0]
    target_logits, draft_q = synthetic_case(7, sampling)
    generator = torch.Generator().manual_seed(11)
    counts = np.zeros(VOCAB)
    for _ in range(8_000):
        counts[sample_sparse(draft_q, generator)] += 1
    target_p = processed_probs(target_logits[:1], sampling)[0].double().numpy()
    assert chi_square_p(counts, target_p) < P_VALUE_FLOOR


def target_marginals(target, prompt, sampling, vocab):
    """Exact marginals of the first two sampled tokens under target-only sampling."""
    with torch.no_grad():
        first = processed_probs(target.model(torch.tensor([prompt])).logits[0, -1:], sampling)[0].double()
        batch = torch.tensor([prompt + [token] for token in range(vocab)])
        second_given_first = processed_probs(target.model(batch).logits[:, -1], sampling).double()
    return first.numpy(), (first @ second_given_first).numpy()


@pytest.mark.parametrize("method,rule,k", [("chain", "rejection", 3), ("chain", "sample-match", 3),
                                           ("fixed-tree", "rejection", 8), ("tree", "sample-match", 8),
                                           ("prompt-lookup-tree", "rejection", 6)])
def test_end_to_end_two_token_marginals_match_target(method, rule, k):
    """Real models, real KV caches, chains and trees: the first two emitted tokens follow the target."""
    from specbench.methods import DraftSource, make_drafter

    vocab = 16
    target = tiny_model(seed=3, vocab_size=vocab, num_layers=SAMPLING_LAYERS)
    draft = tiny_model(seed=4, vocab_size=vocab, noise_from=target, noise_scale=0.01, num_layers=SAMPLING_LAYERS)
    sampling = SamplingParams(temperature=1.5, rule=rule, draft_top_k=8)
    local = LocalTarget(target)
    drafter = make_drafter(method, DraftSource(local, target, draft, tree=TreeShape(widths=(3, 2), beam=2, branch=3,
                                                                                     lookup_candidates=3)))
    check_two_token_marginals(local, target, drafter, Decoding(k, 2, sampling), vocab, prompt=LOOKUP_PROMPT)


# Prompts with repeats, so prompt lookup and suffix decoding find several candidate continuations; the three
# continuations of "1, 2" are ones the target itself rates likely, so their drafts get accepted often enough to
# exercise the acceptance path: REPEATING_PROMPT's 72% together for the 3-layer seed-3 tiny target,
# LOOKUP_PROMPT's 64% for the SAMPLING_LAYERS one (found by trying every three continuations).
REPEATING_PROMPT = [1, 2, 14, 1, 2, 15, 1, 2, 5, 1, 2]
LOOKUP_PROMPT = [1, 2, 12, 1, 2, 8, 1, 2, 11, 1, 2]


def check_two_token_marginals(local, target, drafter, decoding, vocab: int, prompt=REPEATING_PROMPT,
                              draws: int = 1500) -> None:
    """The first two emitted tokens of `draws` seeded generations follow the target's exact marginals,
    with the draft accepted often enough (a tenth of the draws) for the test to exercise acceptance."""
    first_counts, second_counts = np.zeros(vocab), np.zeros(vocab)
    accepted = 0
    for draw in range(draws):
        result = generate(local, drafter, prompt, decoding, seed=5_000 + draw)
        accepted += sum(r.accepted for r in result.records)
        first_counts[result.output_ids[0]] += 1
        second_counts[result.output_ids[1]] += 1
    first_p, second_p = target_marginals(target, prompt, decoding.sampling, vocab)
    assert accepted > draws // 10, "the draft must be accepted often for the test to exercise acceptance"
    assert chi_square_p(first_counts, first_p) > P_VALUE_FLOOR
    assert chi_square_p(second_counts, second_p) > P_VALUE_FLOOR


def test_seeded_runs_are_reproducible(tiny_target, tiny_draft):
    from specbench.api import outputs, run

    sampling = SamplingParams(temperature=1.0, rule="rejection")
    runs = [run(tiny_target, [[1, 2, 3, 4]], method="chain", draft=tiny_draft, sampling=sampling,
                max_new_tokens=20, seed=9, progress=False) for _ in range(2)]
    assert outputs(runs[0]) == outputs(runs[1])
    assert runs[0]["accepted"].tolist() == runs[1]["accepted"].tolist()
    other = run(tiny_target, [[1, 2, 3, 4]], method="chain", draft=tiny_draft, sampling=sampling,
                max_new_tokens=20, seed=10, progress=False)
    assert outputs(other) != outputs(runs[0])


SPECULATIVE = ["chain", "tree", "fixed-tree", "prompt-lookup", "prompt-lookup-tree", "suffix", "suffix-tree",
               "suffix-tree-chain", "suffix-tree-chain-confident"]


def test_sample_match_gives_target_only_text_under_every_draft(tiny_target, tiny_draft):
    """Under sample-match the target draws each position from the seed alone (sampling/streams.py), so a
    seed gives target-only's sampled text token for token whatever drafted it: a check of sampled drafting
    as strict as greedy's. The drafts must be accepted for it to mean anything; under rejection the same
    seeds give another text (the property is sample-match's, not a draft that never counts)."""
    from specbench.api import outputs, run

    prompts = [REPEATING_PROMPT, [3, 4, 5, 6], [7, 1, 2, 7, 1, 2, 7]]
    sampling = SamplingParams(temperature=1.0, top_k=12, rule="sample-match")
    records = run(tiny_target, prompts, method=["target-only"] + SPECULATIVE, draft=tiny_draft, sampling=sampling,
                  max_new_tokens=24, seed=21, k=4, progress=False)
    texts = outputs(records)
    for (method, index), text in texts.items():
        assert text == texts[("target-only", index)], (method, index)
    accepted = records.groupby("method")["accepted"].sum()
    assert (accepted[SPECULATIVE] > 0).all(), accepted.to_dict()
    rejection = run(tiny_target, prompts, method=["target-only", "chain"], draft=tiny_draft, max_new_tokens=24,
                    sampling=replace(sampling, rule="rejection"), seed=21, k=4, progress=False)
    chain = outputs(rejection)
    assert [chain[("chain", i)] for i in range(len(prompts))] != [texts[("target-only", i)] for i in range(len(prompts))]


def test_a_draft_identical_to_the_target_is_always_accepted_under_sample_match(tiny_target):
    """The draft's stream is the target's under sample-match, position for position: a draft that is the target
    proposes exactly the target's draws, so every drafted token is accepted (one position off, and it would
    agree only as often as two independent draws do)."""
    from specbench.api import run

    sampling = SamplingParams(temperature=1.0, top_k=12, rule="sample-match")
    records = run(tiny_target, [REPEATING_PROMPT, [3, 4, 5, 6]], method="chain", draft=tiny_target,
                  sampling=sampling, max_new_tokens=24, seed=21, k=4, progress=False)
    assert records["drafted"].sum() > 20 and (records["accepted"] == records["drafted"]).all()


@pytest.mark.parametrize("method,shape", [("fixed-tree", TreeShape(widths=(2, 1, 1))),
                                          ("tree", TreeShape(max_depth=3, beam=1, branch=1, prune=False))])
def test_a_tree_from_the_target_itself_is_accepted_along_its_first_children_under_sample_match(tiny_target, method,
                                                                                             shape):
    """A coupled tree's first child at every node is the token the target draws there (tree_drafters' children
    race on the target's own E), so with the target as draft every full step accepts the tree's whole depth,
    three levels: a fixed (2, 1, 1) tree in 8 nodes, and a dynamic one of one child a node. Ranked by q instead,
    as before the coupling, such a run accepted 0-2 of 2 levels a step."""
    from specbench.api import run

    sampling = SamplingParams(temperature=1.0, top_k=12, rule="sample-match")
    records = run(tiny_target, [REPEATING_PROMPT, [3, 4, 5, 6]], method=method, draft=tiny_target,
                  sampling=sampling, max_new_tokens=25, seed=21, k=8, progress=False, tree=shape)
    full = records[records["tree_depth"] == 3]  # each prompt's last step drafts no deeper than what is left
    assert len(full) >= 10
    assert (full["accepted"] == 3).all(), full["accepted"].tolist()


def test_a_coupled_dynamic_tree_learns_to_trust_its_leaders(tiny_target):
    """tree_drafters.LeaderRate counts how often the target drew the race's leader (a hit when the next
    context continues with it; a context that does not extend the last one is no evidence), and a dynamic tree
    scores its first children by that rate: with the target as its own draft every leader is drawn, so the
    tree grows along them to its full depth (6) and a step returns 6.7 tokens, where scored by q alone it
    spread wide and returned 3.0."""
    from specbench.api import run
    from specbench.decode.tree_drafters import LeaderRate

    rate = LeaderRate()
    rate.observe([1, 2])  # nothing expected yet
    rate.expect([1, 2], 7)
    rate.observe([1, 2, 7, 3])
    rate.expect([1, 2, 7, 3], 5)
    rate.observe([1, 2, 7, 3, 4])
    rate.expect([1, 2, 7, 3, 4], 9)
    rate.observe([8, 8, 8, 8, 8, 8])  # another generation: not counted
    assert (rate.hits, rate.tries) == (2, 4)

    sampling = SamplingParams(temperature=1.0, top_k=12, rule="sample-match")
    records = run(tiny_target, [REPEATING_PROMPT, [3, 4, 5, 6], [7, 1, 2, 7]], method="tree", draft=tiny_target,
                  sampling=sampling, max_new_tokens=40, seed=21, k=8, progress=False)
    assert records["emitted"].sum() / len(records) > 5.5, records["accepted"].tolist()
