"""Suffix decoding: the index against a brute-force count on random strings, the cache's bounds and
scopes, and lossless decoding (greedy token for token, sampled by chi-square)."""
import random
from collections import OrderedDict
from dataclasses import replace

import pytest

from specbench.api import outputs, run
from specbench.decode.loop import Decoding
from specbench.decode.suffix_drafter import SuffixCache, SuffixDrafter, SuffixSettings
from specbench.decode.suffix_index import SuffixIndex
from specbench.types import SamplingParams, SpecbenchError

from conftest import PROMPTS


def _count(sequences, pattern, depth):
    """How often `pattern` occurs in the sequences (a pattern longer than the depth is never indexed)."""
    if len(pattern) > depth:
        return 0
    n = len(pattern)
    return sum(1 for s in sequences for i in range(len(s) - n + 1) if s[i:i + n] == pattern)


def _brute_chain(sequences, context, budget, depth, min_prob, factor):
    """Suffix decoding's chain by definition: for each match length, follow the most frequent next token
    (ties: the smaller id) while the path probability holds; the highest sum of probabilities wins,
    a tie going to the longer match."""
    best = ((), 0.0, 0)
    for length in range(1, min(len(context), depth - 1) + 1):
        pattern = list(context[len(context) - length:])
        if _count(sequences, pattern, depth) == 0:
            break
        limit = min(budget, int(length * factor + 1e-6))
        tokens, probs, prob, path = [], [], 1.0, pattern
        while len(tokens) < limit:
            here = _count(sequences, path, depth)
            nexts = {t: _count(sequences, path + [t], depth) for t in {tok for s in sequences for tok in s}}
            nexts = {t: c for t, c in nexts.items() if c}
            if not nexts:
                break
            token = min(nexts, key=lambda t: (-nexts[t], t))
            prob *= nexts[token] / here
            if prob < min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            path = path + [token]
        if probs and sum(probs) >= best[1]:
            best = (tuple(tokens), sum(probs), length)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_index_chain_matches_brute_force_on_random_strings(seed):
    rng = random.Random(seed)
    alphabet, depth = rng.choice([2, 3, 5]), rng.choice([3, 5, 8])
    index, sequences = SuffixIndex(depth), {}
    for sequence in range(4):
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(5, 40))]
        for start in range(0, len(tokens), 7):  # appended piece by piece, as a response grows
            index.extend(sequence, tokens[start:start + 7])
        sequences[sequence] = tokens
    index.remove(1)  # an evicted output takes its counts with it
    del sequences[1]
    checked = 0
    for _ in range(40):
        context = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 10))]
        budget, min_prob, factor = rng.choice([1, 3, 8]), rng.choice([0.0, 0.1, 0.4]), rng.choice([1.0, 2.0])
        got = index.speculate(context, budget, min_prob=min_prob, factor=factor)
        want = _brute_chain(list(sequences.values()), context, budget, depth, min_prob, factor)
        assert (got.tokens, got.match_length) == (want[0], want[2] if want[0] else 0), (context, budget)
        assert got.score == pytest.approx(want[1])
        checked += bool(got.tokens)
    assert checked > 5, "most random contexts must find a continuation, or the test checks nothing"


@pytest.mark.parametrize("seed", range(4))
def test_index_tree_takes_the_most_probable_paths(seed):
    rng = random.Random(100 + seed)
    index, sequences = SuffixIndex(8), []
    for sequence in range(3):
        tokens = [rng.randrange(3) for _ in range(30)]
        index.extend(sequence, tokens)
        sequences.append(tokens)
    for _ in range(20):
        context = [rng.randrange(3) for _ in range(4)]
        found = index.speculate(context, 6, tree=True, min_prob=0.05, factor=3.0)
        if not found.tokens:
            continue
        pattern = context[len(context) - found.match_length:]
        paths = []
        for node, parent in enumerate(found.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [found.tokens[node]])
            want = _count(sequences, pattern + paths[-1], 8) / _count(sequences, pattern, 8)
            assert found.probs[node] == pytest.approx(want)  # a node's estimate is its path's share
            assert parent < node
        frontier = [path + [t] for path in [[]] + paths for t in range(3)
                    if path + [t] not in paths and _count(sequences, pattern + path + [t], 8)]
        best_left = max((_count(sequences, pattern + p, 8) / _count(sequences, pattern, 8) for p in frontier),
                        default=0.0)
        assert min(found.probs) >= best_left - 1e-12  # best first: nothing left out beats what was taken


def test_removing_every_sequence_leaves_an_empty_index():
    index = SuffixIndex(6)
    rng = random.Random(1)
    for sequence in range(5):
        index.extend(sequence, [rng.randrange(4) for _ in range(50)])
    for sequence in range(5):
        index.remove(sequence)
    assert index.nodes == 1 and index.root.count == 0 and not index.root.all()


def test_cache_stays_within_its_limits_and_forgets_the_oldest_first():
    cache = SuffixCache(depth=6, max_requests=3, max_tokens=100)
    rng = random.Random(2)
    outputs_ = []
    for _ in range(10):
        output = cache.open()
        cache.extend(output, [rng.randrange(20) for _ in range(30)])
        outputs_.append(output)
        assert len(cache) <= 3 and cache.tokens <= 100
    assert cache.evicted == 7
    assert outputs_[-1] in cache.index and outputs_[0] not in cache.index
    cache.clear()
    assert cache.index.nodes == 1 and cache.tokens == 0


def test_the_cache_tells_an_output_of_the_same_prompt_until_it_is_evicted():
    cache = SuffixCache(depth=6, max_requests=2, max_tokens=100)
    first = cache.open([5, 6, 7])
    cache.extend(first, [1, 2, 3])
    assert cache.holds([5, 6, 7]) and not cache.holds([5, 6]) and not cache.holds([5, 6, 7, 8])
    cache.extend(cache.open(), [4, 4])  # an output of no known prompt (a server's) marks none
    assert cache.holds([5, 6, 7])
    cache.extend(cache.open([9]), [1])  # the third evicts the first
    assert not cache.holds([5, 6, 7]) and cache.holds([9])
    cache.clear()
    assert not cache.holds([9]) and not cache._held  # no count is kept for a prompt no output holds


def test_a_second_run_over_the_same_prompts_says_its_cache_held_their_outputs(tiny_target, tiny_draft):
    """In the shared "process" scope a second call over the same prompts drafts each from its own earlier output;
    the run must say so (rows and a warning naming the remedy), and a "drafter" cache must not be flagged."""
    import warnings

    settings = SuffixSettings(name="repeat test", other_k=2, hand_over=0.5)
    methods = ["target-only", "suffix", "suffix-tree-chain"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run(tiny_target, PROMPTS[:3], method=methods, draft=tiny_draft, k=8, max_new_tokens=16,
                    progress=False, suffix=replace(settings, cache="drafter"))
        once = run(tiny_target, PROMPTS[:3] + PROMPTS[:1], method="suffix-tree-chain", draft=tiny_draft, k=8,
                   max_new_tokens=16, progress=False, suffix=replace(settings, name="repeat test, once"))
        run(tiny_target, PROMPTS[:3], method="suffix", k=8, max_new_tokens=16, progress=False, suffix=settings)
        assert len([w for w in caught if "already held" in str(w.message)]) == 1  # the prompt given twice only
        again = run(tiny_target, PROMPTS[:3], method="suffix", k=8, max_new_tokens=16, progress=False,
                    suffix=settings)
    assert first["cache_held_prompt"].isna().tolist() == (first["method"] == "target-only").tolist()
    assert not first["cache_held_prompt"].fillna(False).any()
    held = once.groupby("prompt_index")["cache_held_prompt"].first().tolist()
    assert held == [False, False, False, True]  # the prompt given twice, the second time
    assert again.groupby("prompt_index")["cache_held_prompt"].first().tolist() == [True, True, True]
    notes = [str(w.message) for w in caught if "already held" in str(w.message)]
    assert len(notes) == 2 and "suffix-tree-chain 1 of 4" in notes[0] and "suffix 3 of 3" in notes[1]
    assert "cache': 'drafter'" in notes[1]


def test_settings_refuse_nonsense_by_name():
    with pytest.raises(SpecbenchError, match="suffix cache must be one of"):
        SuffixSettings(cache="everywhere")
    with pytest.raises(SpecbenchError, match="cache_tokens"):
        SuffixSettings(cache_tokens=0)
    with pytest.raises(SpecbenchError, match="depth must be >= 2"):
        SuffixIndex(1)


def test_command_line_words_become_settings_each_refused_by_name():
    """`specbench run --suffix ...` and `specbench serve --suffix ...`: KEY=VALUE typed as the field."""
    from specbench.cli import build_parser
    from specbench.decode.suffix_drafter import suffix_options
    from specbench.run_command import suffix_settings

    args = build_parser().parse_args(["run", "--method", "suffix", "--suffix", "min_score=2", "factor=2",
                                      "other-k=3", "cache=drafter"])
    assert suffix_settings(args) == SuffixSettings(min_score=2.0, factor=2.0, other_k=3, cache="drafter")
    assert suffix_settings(build_parser().parse_args(["run"])) is None
    for words, message in ((["depth=3.5"], "depth must be a whole number"), (["floor=1"], "KEY one of"),
                           (["min_score"], "KEY=VALUE"), (["min_prob=nan"], "finite"),
                           (["min_prob=2"], "min_prob must be in"), (["cache=everywhere"], "suffix cache must be"),
                           (["min_prob=inf"], "finite number, got"), (["catch_up=nan"], "finite number or inf"),
                           (["catch_up=-2"], "catch_up must be >= 0")):
        with pytest.raises(SpecbenchError, match=message):
            suffix_options(words)
    assert suffix_options(["catch_up=inf", "catch-up=8"]) == {"catch_up": 8.0}
    assert suffix_options(["catch_up=inf"]) == {"catch_up": float("inf")}
    assert suffix_options(["bench_below=0"]) == {"bench_below": 0.0}  # an optional field, typed as its value


def test_an_earlier_output_drafts_a_later_request_only_where_the_cache_is_shared():
    """Two requests in one drafter: the second repeats the first's output, which only a cache carries."""
    first, second = [7, 1, 2, 3, 4, 5, 6, 8, 9], [11, 12]
    for scope, expect_cache in (("drafter", True), ("off", False)):
        drafter = SuffixDrafter(SuffixSettings(depth=8, cache=scope, min_prob=0.0, factor=4.0))
        drafter.propose([7], 4, SamplingParams(), None)
        drafter.finish(first)  # request one's output: 1..9
        tree = drafter.propose(second + [1, 2, 3], 4, SamplingParams(), None)
        if expect_cache:
            assert tree.tokens == (4, 5, 6, 8) and drafter.last_source == "cache"
        else:
            assert tree.tokens == ()
    drafter = SuffixDrafter(SuffixSettings(depth=8, cache="off", factor=4.0))
    assert drafter.propose([3, 4, 5, 3, 4], 4, SamplingParams(), None).tokens == (5, 3, 4)  # its own context


def test_methods_compared_in_one_run_never_draft_from_each_others_output_of_the_prompt(tiny_target):
    """With the process-wide cache, suffix and suffix-tree in one call would each find the other's output of the
    very prompt they draft (interleaved, both run it): each keeps its own cache for the call instead, so it
    drafts as it does alone."""
    name = "compare-in-one-call"
    both = run(tiny_target, PROMPTS, method=["suffix", "suffix-tree"], k=8, max_new_tokens=24, progress=False,
               suffix=SuffixSettings(name=name))
    for method in ("suffix", "suffix-tree"):
        alone = run(tiny_target, PROMPTS, method=method, k=8, max_new_tokens=24, progress=False,
                    suffix=SuffixSettings(name=f"{name} {method}", cache="drafter"))
        assert both[both["method"] == method]["accepted"].tolist() == alone["accepted"].tolist(), method
    shared = run(tiny_target, PROMPTS, method="suffix-tree", k=8, max_new_tokens=24, progress=False,
                 suffix=SuffixSettings(name=name))  # one method: the process cache, with nothing of the call above
    assert shared["accepted"].tolist() == alone["accepted"].tolist()


def test_min_score_drops_only_the_proposals_expected_to_accept_less():
    """(1, 2) is seen three times, twice followed by 3, 4, 5, 9: each token's path probability 2/3, the
    proposal's score 8/3. Drafted under a floor of 2, not under 3, where the step still reports its score."""
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2]
    for min_score, drafted in ((0.0, True), (2.0, True), (3.0, False)):
        drafter = SuffixDrafter(SuffixSettings(depth=8, cache="off", min_prob=0.0, factor=2.0, min_score=min_score))
        tree = drafter.propose(context, 4, SamplingParams(), None)
        assert bool(tree.tokens) is drafted and tree.expected_accepted == pytest.approx(8 / 3)
        if drafted:
            assert tree.tokens == (3, 4, 5, 9)
    with pytest.raises(SpecbenchError, match="min_score must be >= 0"):
        SuffixSettings(min_score=-1.0)


def test_min_score_keeps_greedy_output_and_drafts_less(tiny_target):
    settings = {m: SuffixSettings(cache="drafter", min_score=m) for m in (0.0, 2.0)}
    produced, drafted = {}, {}
    for min_score, suffix in settings.items():
        records = run(tiny_target, PROMPTS, method=["target-only", "suffix"], k=8, max_new_tokens=40, progress=False,
                      suffix=suffix)
        produced[min_score] = outputs(records)
        steps = records[records.method == "suffix"]
        drafted[min_score] = (steps["drafted"] > 0).mean()
        for index in range(len(PROMPTS)):
            assert produced[min_score][("suffix", index)] == produced[min_score][("target-only", index)]
    assert drafted[2.0] < drafted[0.0]  # the floor turned some steps into the target's alone


@pytest.mark.parametrize("k", [1, 4, 16])
def test_suffix_greedy_matches_target_only(tiny_target, k):
    methods = ["target-only", "suffix", "suffix-tree"]
    records = run(tiny_target, PROMPTS, method=methods, k=k, max_new_tokens=40, progress=False,
                  suffix=SuffixSettings(cache="drafter"))
    produced = outputs(records)
    for method in methods[1:]:
        for index in range(len(PROMPTS)):
            assert produced[(method, index)] == produced[("target-only", index)], (method, index, k)
        drafted = records[records.method == method]
        assert 0 < drafted["accepted"].sum() <= drafted["drafted"].sum()
    if k > 1:  # the counts choose each step's length: not always k
        assert records[records.method == "suffix"]["drafted"].nunique() > 1


def test_suffix_through_a_worker_on_either_side(tiny_target, tiny_draft):
    """Client side: the drafter and its cache in the client, the worker verifies (with the draft model beside
    it for `suffix-chain`); server side (`suffix-server`): the worker drafts from its own cache, only finished
    tokens travel."""
    from specbench.worker.client import RemoteTarget
    from worker_helpers import ThreadWorker

    running = ThreadWorker()
    try:
        remote = RemoteTarget(running.endpoint)
        methods = ["suffix", "suffix-tree", "suffix-server", "suffix-tree-server"]
        got = outputs(run(remote, PROMPTS[:3], method=methods, k=6, max_new_tokens=24, progress=False))
        hybrids = ["suffix-chain", "suffix-tree-chain", "suffix-tree-chain-confident"]
        got.update(outputs(run(remote, PROMPTS[:3], method=hybrids, draft=tiny_draft, k=6, max_new_tokens=24,
                               progress=False)))
        methods += hybrids
    finally:
        running.stop()
    local = outputs(run(tiny_target, PROMPTS[:3], method="target-only", max_new_tokens=24, progress=False))
    for method in methods:
        assert [got[(method, i)] for i in range(3)] == [local[("target-only", i)] for i in range(3)], method


def test_a_client_sets_the_worker_side_floor_and_bad_knobs_are_refused_by_name(tiny_target):
    """`suffix-server` drafts on the worker with the client's step knobs (the floor here): greedy output stays
    target-only's, a floor nothing reaches drafts nothing; a malformed `suffix` field is refused by name and
    the worker keeps serving."""
    import numpy as np

    from specbench.worker import protocol
    from specbench.worker.client import RemoteTarget
    from worker_helpers import ThreadWorker

    for bad, message in (({"depth": 3}, "unknown suffix fields"), ({"min_score": -1.0}, "min_score must be >= 0"),
                         ({"other_k": 1.5}, "whole number"), ({"factor": float("nan")}, "finite"),
                         ({"offset": True}, "finite number"), ([1], "must be a map"),
                         ({"cache": 3}, "'cache' must be 'off' or a cache name"),
                         ({"cache": "a\nline"}, "'cache' must be"), ({"cache": "x" * 201}, "'cache' must be"),
                         ({"min_prob": float("inf")}, "must be a finite number$"), ({"catch_up": float("nan")}, "or inf"),
                         ({"catch_up": -1.0}, "catch_up must be >= 0"), ({"trust": 0}, "trust must be > 0"),
                         ({"trust": "2"}, "'trust' must be a finite number \\(or inf\\)"),
                         ({"bench_below": -1.0}, "bench_below must be a finite number >= 0"),
                         ({"bench_below": float("inf")}, "'bench_below' must be a finite number$")):
        with pytest.raises(protocol.ProtocolError, match=message):
            protocol.suffix_from_wire(bad)
    assert protocol.suffix_to_wire(SuffixSettings(cache="off", name="x")) == {"cache": "off"}
    assert protocol.suffix_to_wire(SuffixSettings(min_score=2.0)) == {"min_score": 2.0}  # the worker's own cache
    assert protocol.suffix_to_wire(SuffixSettings(name="mine")) == {"cache": "mine"}
    assert protocol.suffix_to_wire(SuffixSettings(cache="drafter", name="run-1"), "suffix-server") == {
        "cache": "run-1/suffix-server"}
    assert protocol.suffix_from_wire({"cache": "run-1/suffix-server", "min_score": 1}) == {
        "cache": "run-1/suffix-server", "min_score": 1}
    assert protocol.suffix_from_wire({"catch_up": float("inf"), "hand_over": 2}) == {"catch_up": float("inf"),
                                                                                     "hand_over": 2}
    assert protocol.suffix_to_wire(SuffixSettings(catch_up=8.0)) == {"catch_up": 8.0}
    assert protocol.suffix_to_wire(SuffixSettings(trust=float("inf"))) == {"trust": float("inf")}  # the old rule
    assert protocol.suffix_from_wire({"trust": float("inf")}) == {"trust": float("inf")}
    assert protocol.suffix_to_wire(SuffixSettings(bench_below=0.3)) == {"bench_below": 0.3}
    # unset, the worker's drafter picks (0.3 behind a head); an explicit 0, a head's bench turned off, travels
    assert protocol.suffix_to_wire(SuffixSettings(bench_below=0.0)) == {"bench_below": 0.0}
    assert protocol.suffix_to_wire(SuffixSettings()) == {}
    with pytest.raises(SpecbenchError, match=r"\['depth=8'\] are the worker's own"):  # refused, not dropped
        protocol.suffix_to_wire(SuffixSettings(depth=8, min_score=1.0), "suffix-server")
    running = ThreadWorker()
    try:
        remote = RemoteTarget(running.endpoint)
        drafted, got = {}, {}
        for floor in (0.0, 1000.0):
            records = run(remote, PROMPTS[:3], method="suffix-server", k=6, max_new_tokens=24, progress=False,
                          suffix=SuffixSettings(min_score=floor))
            got[floor], drafted[floor] = outputs(records), records["drafted"].sum()
        header = {"op": "generate", "method": "suffix-server", "k": 4, "max_new_tokens": 4, "seed": 0,
                  "sampling": protocol.sampling_to_wire(SamplingParams()), "model": remote.model_identity,
                  "suffix": {"depth": 2}}
        with pytest.raises(SpecbenchError, match="unknown suffix fields"):
            remote._request(header, {"tokens": np.asarray(PROMPTS[0], dtype=np.int32)})
        after = outputs(run(remote, PROMPTS[:1], method="suffix-server", k=6, max_new_tokens=24, progress=False))
    finally:
        running.stop()
    local = outputs(run(tiny_target, PROMPTS[:3], method="target-only", max_new_tokens=24, progress=False))
    for floor in got:
        assert [got[floor][("suffix-server", i)] for i in range(3)] == [local[("target-only", i)] for i in range(3)]
    assert drafted[0.0] > 0 and drafted[1000.0] == 0
    assert after[("suffix-server", 0)] == local[("target-only", 0)]


@pytest.mark.parametrize("tree", [False, True])
def test_suffix_sampling_follows_the_target(tree):
    """Point-mass proposals from counts: the first two sampled tokens follow the target exactly."""
    from specbench.decode.target import LocalTarget
    from specbench.models.tiny import tiny_model
    from test_distributions import LOOKUP_PROMPT, SAMPLING_LAYERS, check_two_token_marginals

    vocab = 16
    target = tiny_model(seed=3, vocab_size=vocab, num_layers=SAMPLING_LAYERS)
    drafter = SuffixDrafter(SuffixSettings(depth=6, cache="off", min_prob=0.0, factor=3.0), tree=tree)
    # a chain proposes the one most seen continuation (13 here, which the target samples ~51% of the time);
    # a tree proposes the three seen after "1, 2" as siblings
    prompt = LOOKUP_PROMPT if tree else [9, 13, 9, 13, 9]
    check_two_token_marginals(LocalTarget(target), target, drafter,
                              Decoding(6, 2, SamplingParams(temperature=1.5, rule="rejection")), vocab, prompt=prompt)
    assert not drafter._active  # the loop calls finish() at each generation's end: no request is left open


def test_copies_of_a_target_in_two_dtypes_keep_their_process_caches_apart():
    """A bf16 copy of a target run beside its fp32 copy in one process (a kernels or dtype comparison) must not
    draft a prompt from the other's output of it: that made bf16 suffix decoding look 3.5x target-only, not 1.5x."""
    from dataclasses import replace

    import torch

    from specbench.models.tiny import tiny_model

    assert tiny_model(seed=5, dtype=torch.bfloat16).spec.dtype == "bfloat16"
    settings = SuffixSettings(name="dtype test")
    first = tiny_model(seed=5)  # and a copy that says bf16 (a tiny random model's bf16 outputs are another text)
    second = replace(tiny_model(seed=5), spec=replace(first.spec, dtype="bfloat16"))
    assert first.spec.label == second.spec.label
    run(first, PROMPTS[:1], method="suffix", k=8, max_new_tokens=12, progress=False, suffix=settings, warmup=False)
    again = run(second, PROMPTS[:1], method="suffix", k=8, max_new_tokens=12, progress=False, suffix=settings,
                warmup=False)
    alone = run(second, PROMPTS[:1], method="suffix", k=8, max_new_tokens=12, progress=False, warmup=False,
                suffix=SuffixSettings(cache="drafter"))
    assert again["accepted"].tolist() == alone["accepted"].tolist()


def test_warm_up_leaves_the_cache_as_it_was(tiny_target):
    """run's discarded warm-up must not put the first prompt's output into the shared cache before it runs."""
    from specbench.decode.suffix_drafter import process_cache
    from specbench.methods import DraftSource, _target_key
    from specbench.decode.target import LocalTarget

    settings = SuffixSettings(name="warm-up test")
    run(tiny_target, PROMPTS[:1], method="suffix", k=8, max_new_tokens=12, progress=False, suffix=settings)
    cache = process_cache(_target_key(DraftSource(LocalTarget(tiny_target), tiny_target)), settings)
    assert len(cache) == 1 and cache.tokens == 12  # the measured prompt's output only


@pytest.mark.parametrize("scope, method", [("tenant", "suffix-server"), ("shared", "suffix-server"),
                                           ("tenant", "suffix-eagle-server")])
def test_worker_keeps_each_tenants_outputs_apart_unless_told_to_share(scope, method, tmp_path, monkeypatch):
    """suffix-server (and the hybrid on the worker, its suffix half): two clients (two tenants) each generate
    once; per tenant, each worker cache holds one output, none of the other's; shared, one cache holds both."""
    from specbench.decode import suffix_drafter
    from specbench.heads.build import new_head
    from specbench.heads.layouts import save_head
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget
    from worker_helpers import TARGET, ThreadWorker

    from collections import OrderedDict

    monkeypatch.setattr(suffix_drafter, "_PROCESS_CACHES", OrderedDict())  # only this test's caches are read
    head = None
    if method == "suffix-eagle-server":  # a head the worker may load, drafting where the suffix cache has nothing
        head = str(save_head(new_head(load_model(ModelSpec(TARGET)), seed=3), tmp_path / "head"))
    running = ThreadWorker(suffix_cache=scope, allow_load=(head,) if head else ())
    try:
        for prompt in PROMPTS[:2]:  # a client each: each RemoteTarget is a tenant of its own
            run(RemoteTarget(running.endpoint), [prompt], method=method, k=6, max_new_tokens=12, draft=head,
                progress=False, warmup=False)
    finally:
        running.stop()
    # process caches by key (target label, dtype, vocabulary, "worker", worker model[, tenant]), most recent last
    worker = [(key[0], cache) for key, cache in suffix_drafter._PROCESS_CACHES.items() if "worker" in key[0]]
    if scope == "tenant":
        assert [len(cache) for key, cache in worker if len(key) == 6] == [1, 1]
    else:
        assert len([cache for key, cache in worker if len(key) == 5][-1]) == 2


def test_worker_methods_compared_in_one_run_each_draft_from_their_own_cache_there(tiny_target):
    """suffix-server and suffix-tree-server in one call, interleaved per prompt, would each find the other's
    output of the very prompt in their tenant's worker cache: each names a cache of its own there for the call
    (and the warm-up feeds none), so each drafts as it does alone with a fresh cache, and the tenant's own
    cache is left as it was."""
    from specbench.worker.client import RemoteTarget
    from worker_helpers import ThreadWorker

    methods = ["suffix-server", "suffix-tree-server"]
    running = ThreadWorker()
    try:
        remote = RemoteTarget(running.endpoint)
        both = run(remote, PROMPTS, method=methods, k=8, max_new_tokens=24, progress=False)
        alone = {method: run(remote, PROMPTS, method=method, k=8, max_new_tokens=24, progress=False,
                             suffix=SuffixSettings(cache="drafter")) for method in methods}
        shared = [run(remote, PROMPTS[:1], method="suffix-server", k=8, max_new_tokens=24, progress=False)
                  for _ in range(2)]  # one method: the tenant's cache, which nothing above fed
        stats = remote.stats()
    finally:
        running.stop()
    for method in methods:
        assert both[both["method"] == method]["accepted"].tolist() == alone[method]["accepted"].tolist(), method
    assert shared[0]["accepted"].tolist() == alone["suffix-server"][lambda r: r.prompt_index == 0][
        "accepted"].tolist()  # the first time, the prompt is new to the tenant's cache, warm-up included
    assert sum(shared[1]["accepted"]) > sum(shared[0]["accepted"])  # the second time, its output is there
    assert not shared[0]["cache_held_prompt"].any() and shared[1]["cache_held_prompt"].all()  # and the rows say so
    assert not both["cache_held_prompt"].any()
    assert stats["suffix_caches"] >= 5 and stats["suffix_cache_tokens"] >= 24 * (4 * len(PROMPTS) + 2)  # its memory


def test_a_tenant_keeps_a_few_named_caches_and_may_turn_its_cache_off(monkeypatch):
    """A request names a cache of its tenant's own, or none: past `NAMED_CACHES_PER_TENANT` names the least
    recently used cache is dropped (names cannot grow a tenant's memory), never another tenant's; 'off' drafts
    from nothing kept, and a worker started with its cache off keeps none whatever a client names."""
    from types import SimpleNamespace

    from specbench.decode import suffix_drafter
    from specbench.worker import long_requests

    monkeypatch.setattr(suffix_drafter, "_PROCESS_CACHES", OrderedDict())
    ops = SimpleNamespace(config=SimpleNamespace(suffix_cache="tenant"), identity="m", suffix_names={})
    cap = long_requests.NAMED_CACHES_PER_TENANT
    other_settings, other_key = long_requests._suffix_scope(ops, "bob", {"cache": "bob's"})
    suffix_drafter.process_cache(other_key, other_settings)
    for index in range(cap + 2):
        settings, key = long_requests._suffix_scope(ops, "ann", {"cache": f"n{index}", "min_score": 1.0})
        assert settings.cache == "process" and settings.min_score == 1.0 and key[-2:] == ("named", f"n{index}")
        suffix_drafter.process_cache(key, settings)
    kept = [key[-1] for key, *_ in suffix_drafter._PROCESS_CACHES]
    assert kept == ["bob's"] + [f"n{index}" for index in range(2, cap + 2)]
    assert long_requests._suffix_scope(ops, "ann", {})[1] == ("worker", "m", "ann")  # the tenant's own
    assert long_requests._suffix_scope(ops, "ann", {"cache": "off"})[0].cache == "off"
    ops.config.suffix_cache = "off"
    assert long_requests._suffix_scope(ops, "ann", {"cache": "n3"})[0].cache == "off"
    ops.config.suffix_cache = "shared"
    assert long_requests._suffix_scope(ops, "ann", {})[1] == ("worker", "m")
    assert long_requests._suffix_scope(ops, "ann", {"cache": "n3"})[1] == ("worker", "m", "ann", "named", "n3")


@pytest.mark.parametrize("method", ["suffix-chain", "suffix-tree-chain", "suffix-tree-chain-confident"])
def test_suffix_with_a_draft_model_drafts_from_whichever_vouches_and_stays_lossless(tiny_target, tiny_draft, method):
    """`suffix-chain`: a step whose suffix proposal expects at least `hand_over` accepted tokens is drafted by
    suffix decoding, every other by the draft model (whose cache catches up on the steps it missed); on
    prompts that repeat themselves both draft, and greedy output equals target-only token for token."""
    from specbench.decode.loop import generate
    from specbench.decode.target import LocalTarget
    from specbench.methods import DraftSource, make_drafter

    prompts = PROMPTS + [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [11]]
    local = LocalTarget(tiny_target)
    got = outputs(run(local, prompts, method=["target-only", method], draft=tiny_draft, k=6, max_new_tokens=24,
                      progress=False, warmup=False, suffix=SuffixSettings(cache="drafter", other_k=3)))
    drafter = make_drafter(method, DraftSource(local, tiny_target, tiny_draft,
                                               suffix=SuffixSettings(cache="drafter", other_k=3)))
    for index, prompt in enumerate(prompts):
        assert got[(method, index)] == got[("target-only", index)], index
        result = generate(local, drafter, prompt, Decoding(6, 24))
        assert result.output_ids == got[("target-only", index)], index
    assert drafter.steps["suffix"] > 0 and drafter.steps["other"] > 0, drafter.steps
    with pytest.raises(SpecbenchError, match="needs a draft model"):
        make_drafter(method, DraftSource(local, tiny_target, None))


def test_the_draft_model_drafts_at_most_its_own_budget_in_the_hybrid(tiny_target, tiny_draft):
    """`other_k` caps the draft model's steps (a model's chain pays at a few tokens), not suffix decoding's."""
    from specbench.decode.target import LocalTarget
    from specbench.methods import DraftSource, make_drafter

    drafter = make_drafter("suffix-chain", DraftSource(LocalTarget(tiny_target), tiny_target, tiny_draft,
                                                       suffix=SuffixSettings(cache="off", other_k=2)))
    import torch

    draws = torch.Generator().manual_seed(0)
    fresh = drafter.propose([1, 2, 3, 4, 5], 8, SamplingParams(), draws)  # nothing repeats: the model drafts
    assert drafter.last_source == "other" and len(fresh) == 2
    repeating = drafter.propose([5, 6, 7, 8, 9] * 4 + [5, 6], 8, SamplingParams(), draws)
    assert drafter.last_source == "suffix" and len(repeating) > 2


def test_the_confident_hybrids_chain_ends_where_its_draft_is_unsure_not_at_other_k(tiny_target, tiny_draft):
    """`suffix-tree-chain-confident`: a step suffix decoding does not vouch for goes to chain-confident's chain,
    which runs to the step's k while the draft is sure (stop_below 0: always) and ends at the first token the
    draft gave less than stop_below; `other_k` (2 here) does not cap it."""
    import torch

    from specbench.decode.target import LocalTarget
    from specbench.methods import DraftSource, make_drafter

    settings = SuffixSettings(cache="off", other_k=2)
    lengths = {}
    for stop_below in (0.0, 0.999):
        drafter = make_drafter("suffix-tree-chain-confident", DraftSource(
            LocalTarget(tiny_target), tiny_target, tiny_draft, suffix=settings, stop_below=stop_below))
        proposal = drafter.propose([1, 2, 3, 4, 5], 8, SamplingParams(), torch.Generator().manual_seed(0))
        assert drafter.last_source == "other" and drafter.name == "suffix-tree-chain-confident"
        lengths[stop_below] = len(proposal)
    assert lengths[0.0] == 8 and 1 <= lengths[0.999] < 8, lengths


def test_the_draft_model_leaves_a_step_to_suffix_decoding_when_it_has_too_much_to_read(tiny_target, tiny_draft):
    """`catch_up`: the draft model drafts only while what it must read first (the whole prompt on a fresh
    cache) is at most catch_up x the tokens still to emit (max_depth + 1); else suffix decoding keeps the step,
    and the model reads nothing. Greedy output stays target-only's, with both kinds of step taken."""
    import torch

    from specbench.decode.loop import generate
    from specbench.decode.target import LocalTarget
    from specbench.methods import DraftSource, make_drafter

    local = LocalTarget(tiny_target)
    settings = SuffixSettings(cache="off", other_k=2, catch_up=1.0)
    drafter = make_drafter("suffix-chain", DraftSource(local, tiny_target, tiny_draft, suffix=settings))
    model, draws, fresh = drafter.other, torch.Generator().manual_seed(0), list(range(1, 31))
    assert model.pending(fresh) == 30
    drafter.propose(fresh, 8, SamplingParams(), draws, max_depth=9)  # 30 to read > 1 x 10 still to emit
    assert drafter.last_source == "suffix" and drafter.kept_for_catch_up == 1 and model.cached_ids == []
    drafter.propose(fresh, 8, SamplingParams(), draws, max_depth=29)  # 30 <= 30: worth reading
    assert drafter.last_source == "other" and model.pending(fresh + [40, 41]) <= 3
    drafter.propose(fresh + [40, 41], 8, SamplingParams(), draws, max_depth=2)  # a step's worth to read
    assert drafter.last_source == "other"
    prompts = PROMPTS + [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [11]]
    expected = outputs(run(local, prompts, method="target-only", max_new_tokens=24, progress=False, warmup=False))
    drafter = make_drafter("suffix-chain", DraftSource(local, tiny_target, tiny_draft, suffix=replace(
        settings, catch_up=0.5)))
    for index, prompt in enumerate(prompts):
        assert generate(local, drafter, prompt, Decoding(6, 24)).output_ids == expected[("target-only", index)]
    assert drafter.kept_for_catch_up > 0 and drafter.steps["other"] > 0, (drafter.kept_for_catch_up, drafter.steps)


@pytest.mark.parametrize("method,rule", [("suffix-chain", "rejection"), ("suffix-tree-chain", "sample-match"),
                                         ("suffix-tree-chain-confident", "rejection")])
def test_sampled_drafting_with_suffix_and_a_draft_model_keeps_the_targets_distribution(method, rule):
    """Each step's proposal carries its own drafter's q (a point mass for suffix decoding, the draft model's
    distribution otherwise): the first two tokens follow the target's marginals (chi-square), with both
    drafters proposing across the draws."""
    from specbench.decode.target import LocalTarget
    from specbench.methods import DraftSource, make_drafter
    from specbench.models.tiny import tiny_model
    from test_distributions import LOOKUP_PROMPT, SAMPLING_LAYERS, check_two_token_marginals

    vocab = 16
    target = tiny_model(seed=3, vocab_size=vocab, num_layers=SAMPLING_LAYERS)
    draft = tiny_model(seed=4, vocab_size=vocab, noise_from=target, noise_scale=0.3, num_layers=SAMPLING_LAYERS)
    local = LocalTarget(target)
    drafter = make_drafter(method, DraftSource(local, target, draft,
                                               suffix=SuffixSettings(cache="drafter", hand_over=0.5, other_k=2)))
    check_two_token_marginals(local, target, drafter,
                              Decoding(3, 3, SamplingParams(temperature=1.5, rule=rule, draft_top_k=8)), vocab,
                              prompt=LOOKUP_PROMPT)
    assert min(drafter.steps.values()) > 100, drafter.steps


def test_a_hybrid_hands_a_request_to_the_model_once_suffix_decodings_drafts_there_fail():
    """Suffix decoding's counts promise a continuation ("1 2" was followed by "3 4 5 6" five times); a request
    whose text never continues that way (each step's new tokens start elsewhere) has its record fall, and after a
    few steps the other drafter gets them, while with `trust` inf every step stays suffix decoding's. A request
    that does continue as promised keeps its steps. The accepted tokens are read off the context: the deepest path
    of the last proposal it continues with."""
    import math

    import torch

    from specbench.decode.hybrid_drafter import HybridDrafter
    from specbench.decode.suffix_drafter import SuffixDrafter
    from specbench.types import DraftTree, SamplingParams

    class Other:  # the model's stand-in: one token, and a count of its steps
        def propose(self, context, k, sampling, draws, max_depth=None):
            return DraftTree.chain((77,))

    def steps(trust: float, copies: bool) -> dict:
        suffix = SuffixDrafter(SuffixSettings(cache="drafter"))
        for _ in range(5):
            suffix.remember([1, 2, 3, 4, 5, 6])
        hybrid = HybridDrafter(suffix, Other(), hand_over=0.5, trust=trust)
        context = [50, 51, 1, 2]
        for step in range(8):
            found = hybrid.propose(context, 4, SamplingParams(), torch.Generator())
            # the target: either the proposal and a bonus, or a token of its own, then "1 2" again
            context = context + (list(found.tokens) + [1, 2] if copies and hybrid.last_source == "suffix"
                                 else [100 + step, 1, 2])
        return dict(hybrid.steps)

    assert steps(math.inf, copies=False) == {"suffix": 8, "other": 0}
    failing = steps(2.0, copies=False)
    assert failing["other"] >= 5 and failing["suffix"] >= 1, failing
    assert steps(2.0, copies=True) == {"suffix": 8, "other": 0}
    tree = DraftTree((3, 9, 4, 5), (-1, -1, 0, 2))  # 3 -> 4 -> 5 and 9
    assert [tree.followed(new) for new in ([3, 4, 5, 8], [3, 4, 7], [9, 3], [8], [])] == [3, 2, 1, 0, 0]


def test_a_hybrid_benches_its_other_drafter_in_a_request_where_its_drafts_fail(tiny_target, tiny_draft):
    """`bench_below`: where suffix decoding has nothing to propose, the other drafter drafts; in a request where
    its drafts are never accepted it is benched once (accepted + 1) / (steps + 1) falls below the floor (after 2
    steps at 0.5) and suffix decoding's empty proposal takes the rest; one whose drafts are kept stays; 0 never
    benches; a run with it is target-only's output token for token."""
    import math

    import torch

    from specbench.decode.hybrid_drafter import HybridDrafter
    from specbench.decode.suffix_drafter import SuffixDrafter
    from specbench.types import DraftTree, SamplingParams

    class Other:
        def propose(self, context, k, sampling, draws, max_depth=None):
            return DraftTree.chain((77,))

    def steps(bench_below: float, kept: bool) -> tuple[dict, int]:
        hybrid = HybridDrafter(SuffixDrafter(SuffixSettings(cache="drafter")), Other(), hand_over=0.5,
                               trust=math.inf, bench_below=bench_below)
        context = [50, 51]
        for step in range(8):
            found = hybrid.propose(context, 4, SamplingParams(), torch.Generator())
            context = context + (list(found.tokens) + [200 + step] if kept and len(found) else [100 + step])
        return dict(hybrid.steps), hybrid.benched

    assert steps(0.5, kept=False) == ({"suffix": 6, "other": 2}, 6)
    assert steps(0.0, kept=False) == ({"suffix": 0, "other": 8}, 0)
    assert steps(0.5, kept=True) == ({"suffix": 0, "other": 8}, 0)
    with pytest.raises(SpecbenchError, match="bench_below"):
        SuffixSettings(bench_below=-1)
    settings = SuffixSettings(cache="drafter", hand_over=0.5, other_k=3, bench_below=0.9)
    got = outputs(run(tiny_target, PROMPTS, method=["target-only", "suffix-chain", "suffix-tree-chain"],
                      draft=tiny_draft, k=6, max_new_tokens=24, progress=False, warmup=False, suffix=settings))
    for index in range(len(PROMPTS)):
        assert got[("suffix-chain", index)] == got[("suffix-tree-chain", index)] == got[("target-only", index)]
