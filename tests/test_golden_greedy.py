"""Tier 3: greedy speculative decoding equals greedy target-only decoding token for token (fp32)."""
import pandas as pd
import pytest
import torch

from specbench.api import outputs, run
from specbench.decode.drafters import ModelDrafter
from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.models.self_draft import truncated_view
from specbench.types import DraftTree, SamplingParams

from conftest import PROMPTS

GREEDY = SamplingParams()


@pytest.mark.parametrize("k", [1, 3, 6, 16])
def test_every_drafter_matches_target_only(tiny_target, tiny_draft, k):
    methods = ["target-only", "chain", "tree", "fixed-tree", "prompt-lookup", "prompt-lookup-tree", "self-draft"]
    records = run(tiny_target, PROMPTS, method=methods, draft=tiny_draft, k=k, max_new_tokens=40, progress=False)
    produced = outputs(records)
    for method in methods[1:]:
        for index in range(len(PROMPTS)):
            assert produced[(method, index)] == produced[("target-only", index)], (method, index)
    chain = records[records.method == "chain"]
    # A test that could not fail would see acceptance of exactly 0 or 1: both outcomes must occur.
    assert 0 < chain["accepted"].sum() < chain["drafted"].sum()
    assert all(len(produced[("target-only", i)]) == 40 for i in range(len(PROMPTS)))


def test_draft_equal_to_target_accepts_everything(tiny_target):
    records = run(tiny_target, PROMPTS[:2], method="chain", draft=tiny_target, k=4, max_new_tokens=21,
                  progress=False)
    assert records["accepted"].sum() == records["drafted"].sum()
    assert list(records.groupby("prompt_index")["emitted"].sum()) == [21, 21]
    assert records["emitted"].iloc[0] == 5  # 4 drafts + the bonus


def test_rejection_and_sample_match_rules_under_greedy_settings_match(tiny_target, tiny_draft):
    base = outputs(run(tiny_target, PROMPTS, method="target-only", max_new_tokens=25, progress=False))
    for rule in ("rejection", "sample-match"):
        got = outputs(run(tiny_target, PROMPTS, method="chain", draft=tiny_draft, max_new_tokens=25,
                          sampling=SamplingParams(temperature=0.0, rule=rule), progress=False))
        assert [got[("chain", i)] for i in range(len(PROMPTS))] == [base[("target-only", i)] for i in range(len(PROMPTS))]


def test_eos_inside_an_accepted_run_stops_there(tiny_target):
    baseline = outputs(run(tiny_target, PROMPTS[:1], method="target-only", max_new_tokens=30, progress=False))
    reference = baseline[("target-only", 0)]
    eos = reference[6]
    stop = reference.index(eos)
    local = LocalTarget(tiny_target, eos_token_ids=(eos,))
    # The draft is the target itself, so the EOS token arrives in the middle of a fully accepted chain.
    drafter = ModelDrafter(tiny_target, local.vocab_size)
    result = generate(local, drafter, PROMPTS[0], Decoding(5, 30, GREEDY))
    assert result.output_ids == reference[: stop + 1]
    last = result.records[-1]
    assert last.accepted > last.emitted - 1, "EOS should have cut an accepted run short"


class RandomTreeDrafter:
    """Proposes a random tree that contains the true greedy continuation on one branch."""

    name = "random-tree"

    def __init__(self, oracle, vocab, seed=0):
        self.oracle, self.vocab = oracle, vocab
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, context, budget, sampling, generator, max_depth=None):
        """Ignores budget and depth cap on purpose: the loop must truncate past max_new_tokens itself."""
        truth = self.oracle(context, 3)
        tokens, parents = [], []
        parent = -1
        for depth, token in enumerate(truth):
            wrong = int(torch.randint(0, self.vocab, (), generator=self.generator))
            tokens += [wrong, token] if depth % 2 else [token, wrong]
            parents += [parent, parent]
            parent = len(tokens) - (1 if depth % 2 else 2)
        # An off-path leaf deepens the tree without being accepted.
        tokens.append(int(torch.randint(0, self.vocab, (), generator=self.generator)))
        parents.append(len(tokens) - 2)
        return DraftTree(tuple(tokens), tuple(parents))


def test_tree_verification_keeps_greedy_output(tiny_target):
    base_target = LocalTarget(tiny_target)
    reference = {}

    def oracle(context, n):
        key = tuple(context)
        generated = generate(base_target, None, list(context), Decoding(1, n, GREEDY), session="oracle").output_ids
        reference[key] = generated
        return generated

    local = LocalTarget(tiny_target)
    drafter = RandomTreeDrafter(oracle, local.vocab_size)
    for prompt in PROMPTS:
        expected = generate(base_target, None, prompt, Decoding(1, 24, GREEDY)).output_ids
        got = generate(local, drafter, prompt, Decoding(8, 24, GREEDY))
        assert got.output_ids == expected
        assert sum(r.accepted for r in got.records) > 0


@pytest.mark.real_model
def test_smollm2_self_draft_matches_target_only(smollm2):
    prompts = ["Write a Python function that reverses a string.", "Name three primary colours."]
    records = run(smollm2, prompts, method=["target-only", "self-draft", "prompt-lookup"], k=4,
                  max_new_tokens=20, self_draft_layers=26, progress=False, warmup=False)
    from specbench.models.self_draft import truncated_view

    trees = run(smollm2, prompts, method=["tree"], draft=truncated_view(smollm2, 26), k=8,
                max_new_tokens=20, progress=False, warmup=False)
    records = pd.concat([records, trees])
    produced = outputs(records)
    for method in ("self-draft", "prompt-lookup", "tree"):
        for index in range(len(prompts)):
            assert produced[(method, index)] == produced[("target-only", index)], (method, index)
    assert records[records.method == "self-draft"]["accepted"].sum() > 0


def test_self_draft_view_shares_weights(tiny_target):
    view = truncated_view(tiny_target, 1)
    assert view.model.lm_head.weight.data_ptr() == tiny_target.model.lm_head.weight.data_ptr()
    assert len(view.model.model.layers) == 1
