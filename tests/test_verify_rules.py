"""Tier 1: hand-built logits force each verification rule's accept/reject outcome."""
import pytest
import torch

from specbench.sampling.verify import verify
from specbench.types import DraftTree, SamplingParams, SparseDist, SpecbenchError

VOCAB = 10
GREEDY = SamplingParams()
REJECTION = SamplingParams(temperature=1.0, rule="rejection")
SAMPLE_MATCH = SamplingParams(temperature=1.0, rule="sample-match")


def peaked(*tokens, height=50.0):
    """Logits rows [len(tokens), VOCAB], each all but certain of its token."""
    rows = torch.zeros(len(tokens), VOCAB)
    for row, token in enumerate(tokens):
        rows[row, token] = height
    return rows


def point(token):
    return SparseDist((token,), (1.0,))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_accepts_matching_prefix_and_adds_target_token():
    tree = DraftTree.chain([5, 7, 9])
    assert verify(tree, peaked(5, 7, 4, 1), GREEDY, gen()) == ((0, 1), 4)


def test_greedy_all_accepted_adds_bonus_from_last_row():
    assert verify(DraftTree.chain([5, 7]), peaked(5, 7, 3), GREEDY, gen()) == ((0, 1), 3)


def test_greedy_first_rejected():
    assert verify(DraftTree.chain([2, 7]), peaked(5, 7, 3), GREEDY, gen()) == ((), 5)


def test_greedy_empty_tree_is_target_only():
    assert verify(DraftTree(), peaked(6), GREEDY, gen()) == ((), 6)


def test_greedy_tree_follows_the_matching_sibling():
    # root children: node0=3, node1=5; node2=8 under node1; target says 5 then 8 then 1
    tree = DraftTree(tokens=(3, 5, 8), parents=(-1, -1, 1))
    logits = torch.zeros(4, VOCAB)
    logits[0, 5] = logits[2, 8] = logits[3, 1] = logits[1, 9] = 10.0
    assert verify(tree, logits, GREEDY, gen()) == ((1, 2), 1)


@pytest.mark.parametrize("seed", range(5))
def test_rejection_accepts_when_target_covers_draft(seed):
    # p(7) ~ 1 >= q(7) = 1: min(1, p/q) ~ 1, accepted for any coin
    tree = DraftTree.chain([7], [point(7)])
    assert verify(tree, peaked(7, 2), REJECTION, gen(seed)) == ((0,), 2)


@pytest.mark.parametrize("seed", range(5))
def test_rejection_rejects_impossible_token_and_resamples_residual(seed):
    # p puts ~0 on 4; residual (p - q)+ = p, which is all but certain of 6
    tree = DraftTree.chain([4, 1], [point(4), point(1)])
    assert verify(tree, peaked(6, 1, 1), REJECTION, gen(seed)) == ((), 6)


def test_rejection_residual_excludes_the_rejected_token():
    # p = {2: .5, 3: .5}, q = {2: 1}: when 2 is rejected the recovered token must be 3
    logits = torch.full((2, VOCAB), -1e9)
    logits[0, 2] = logits[0, 3] = 0.0
    logits[1, 0] = 0.0
    tree = DraftTree.chain([2], [point(2)])
    outcomes = {verify(tree, logits, REJECTION, gen(seed)) for seed in range(40)}
    assert outcomes == {((0,), 0), ((), 3)}


def test_recursive_rejection_tries_the_next_sibling():
    # siblings 4 and 6 drawn from q = {4: .5, 6: .5}; p ~ one-hot on 6: 4 is rejected, 6 accepted
    q = SparseDist((4, 6), (0.5, 0.5))
    tree = DraftTree(tokens=(4, 6), parents=(-1, -1), draft_dists=(q, q))
    for seed in range(10):
        assert verify(tree, peaked(6, 0, 9), REJECTION, gen(seed)) == ((1,), 9)


def test_sample_match_follows_certain_target():
    tree = DraftTree.chain([3, 8])
    assert verify(tree, peaked(3, 2, 5), SAMPLE_MATCH, gen()) == ((0,), 2)


def test_sample_match_draws_each_position_from_the_seed_alone():
    """Given the position, the token drawn there depends on the seed and the target's row only: a chain
    drafting exactly the draws of positions 10 and 11 is accepted whole with position 12's as bonus, a
    wrong draft still gets position 10's draw, and the draws differ from position to position."""
    rows = torch.zeros(3, VOCAB)  # uniform: each draw is the position's own uniform

    def alone(position):
        return verify(DraftTree(), rows[:1], SAMPLE_MATCH, gen(4), position=position)[1]

    first, second, third = alone(10), alone(11), alone(12)
    assert verify(DraftTree.chain([first, second]), rows, SAMPLE_MATCH, gen(4), position=10) == ((0, 1), third)
    wrong = DraftTree.chain([(first + 1) % VOCAB])
    assert verify(wrong, rows[:2], SAMPLE_MATCH, gen(4), position=10) == ((), first)
    siblings = DraftTree(((first + 1) % VOCAB, first), (-1, -1))  # the matching child, wherever it sits
    assert verify(siblings, rows, SAMPLE_MATCH, gen(4), position=10) == ((1,), second)
    assert len({alone(position) for position in range(40)}) > 3
    assert len({verify(DraftTree(), rows[:1], SAMPLE_MATCH, gen(seed), position=10)[1] for seed in range(40)}) > 3


def test_a_shorter_draw_of_uniforms_is_the_start_of_a_longer_one():
    """What a coupled draft relies on (probs.coupled_draw_sparse draws noise only up to its largest id): if a
    torch release broke it, the drafts would stop landing on the target's draws (still lossless, slower)."""
    longer = torch.rand(151_936, generator=gen(5))
    for size in (3, 16, 17, 5_000, 49_152):
        assert torch.equal(torch.rand(size, generator=gen(5)), longer[:size])


def test_rejection_without_q_is_refused_by_name():
    with pytest.raises(SpecbenchError, match="sample-match"):
        verify(DraftTree.chain([1]), peaked(1, 1), REJECTION, gen())


def test_greedy_settings_make_every_rule_greedy():
    assert SamplingParams(temperature=0.0, rule="rejection").effective_rule == "greedy"
    tree = DraftTree.chain([5, 7], [point(5), point(7)])
    assert verify(tree, peaked(5, 1, 3), SamplingParams(rule="rejection"), gen()) == ((0,), 1)


@pytest.mark.parametrize("tokens,parents", [((1, 2), (1, -1)), ((1, 2), (-1, 5)), ((1,), (0,))])
def test_bad_trees_are_refused(tokens, parents):
    with pytest.raises(SpecbenchError, match="parent"):
        DraftTree(tokens=tokens, parents=parents)


def test_row_count_must_match_tree():
    with pytest.raises(SpecbenchError, match="rows"):
        verify(DraftTree.chain([1, 2]), peaked(1), GREEDY, gen())


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2),
                                    dict(rule="nope"), dict(draft_top_k=0)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(SpecbenchError):
        SamplingParams(**kwargs)


def test_a_sampled_run_defaults_to_the_rule_its_methods_can_take():
    """Rejection unless a method's drafts have no rejection rule (a dynamic tree: which nodes it keeps depends on
    the tokens drawn) or are routed: then sample-match for all, rather than an error after the models load."""
    from specbench.methods import sampled_rule

    assert sampled_rule(0.0, ["tree"]) == "greedy"
    assert sampled_rule(0.8, ["target-only", "chain:3", "fixed-tree", "suffix-tree"]) == "rejection"
    for names in (["chain", "tree"], ["eagle-tree"], ["suffix-eagle-tree"], ["auto"]):
        assert sampled_rule(0.8, names) == "sample-match", names


def test_a_temperature_under_the_greedy_rule_is_refused():
    """Greedy verification at a temperature returns the argmax text: the temperature would be ignored."""
    with pytest.raises(SpecbenchError, match="pass rule='rejection' or 'sample-match'"):
        SamplingParams(temperature=0.8)
    assert SamplingParams(temperature=0.8, rule="rejection").effective_rule == "rejection"
