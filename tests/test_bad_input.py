"""Bad input gets a clear error that names the problem."""
import pytest
import torch

from specbench.api import run
from specbench.decode.drafters import PromptLookupDrafter
from specbench.decode.target import LocalTarget, UnknownSessionError
from specbench.models.loading import VocabMismatchError, check_vocab_compatible
from specbench.models.spec import ModelSpec
from specbench.models.tiny import tiny_model
from specbench.types import DraftTree, SamplingParams, SpecbenchError


def test_out_of_vocab_prompt(tiny_target):
    with pytest.raises(SpecbenchError, match=r"prompt\[1\] = 5000 is out of vocabulary"):
        run(tiny_target, [[1, 5000]], method="target-only", progress=False)


def test_negative_and_non_integer_ids(tiny_target):
    target = LocalTarget(tiny_target)
    with pytest.raises(SpecbenchError, match="out of vocabulary"):
        target.prefill("s", [-1])
    with pytest.raises(SpecbenchError, match="not an integer"):
        target.prefill("s", [1, "a"])


def test_out_of_vocab_draft_token(tiny_target):
    target = LocalTarget(tiny_target)
    target.prefill("s", [1, 2, 3])
    with pytest.raises(SpecbenchError, match="draft tree token"):
        target.verify("s", DraftTree.chain([1, 10_000]), SamplingParams(), 0)
    # the session survives the refusal and still verifies
    assert target.verify("s", DraftTree.chain([1]), SamplingParams(), 0).bonus_token >= 0


def test_empty_prompt(tiny_target):
    with pytest.raises(SpecbenchError, match="empty"):
        run(tiny_target, [[]], method="target-only", progress=False)


@pytest.mark.parametrize("k", [0, -3])
def test_nonpositive_k(tiny_target, k):
    with pytest.raises(SpecbenchError, match="k .* must be >= 1"):
        run(tiny_target, [[1, 2, 3]], method="prompt-lookup", k=k, progress=False)


def test_unknown_method(tiny_target):
    with pytest.raises(SpecbenchError, match="unknown method 'medusa'"):
        run(tiny_target, [[1, 2]], method="medusa", progress=False)


def test_chain_without_draft(tiny_target):
    with pytest.raises(SpecbenchError, match="needs a draft"):
        run(tiny_target, [[1, 2]], method="chain", progress=False)


def test_unknown_session(tiny_target):
    with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
        LocalTarget(tiny_target).verify("nope", DraftTree(), SamplingParams(), 0)


def test_context_overflow(tiny_target):
    target = LocalTarget(tiny_target, max_context=10)
    with pytest.raises(SpecbenchError, match="exceeds the target's context"):
        target.prefill("s", list(range(11)))


def test_vocab_mismatch_refused(tiny_target):
    other = tiny_model(seed=5, vocab_size=50)
    with pytest.raises(VocabMismatchError, match="output ids"):
        check_vocab_compatible(other, tiny_target)


def test_bad_model_spec():
    with pytest.raises(SpecbenchError, match="quantization"):
        ModelSpec("x", quantization="3bit")
    with pytest.raises(SpecbenchError, match="empty"):
        ModelSpec("")


def test_unknown_catalog_model():
    from specbench.models.catalog import catalog_entry

    with pytest.raises(SpecbenchError, match="unknown catalog model 'nope'"):
        catalog_entry("nope")


def test_prompt_lookup_worked_example():
    assert PromptLookupDrafter(max_ngram=2).lookup([1, 2, 3, 4, 2, 3], 2) == [4, 2]
    assert PromptLookupDrafter().lookup([1, 2, 3], 4) == []


def test_text_prompt_needs_tokenizer(tiny_target):
    with pytest.raises(SpecbenchError, match="no tokenizer"):
        run(tiny_target, ["hello"], method="target-only", progress=False)


def test_dataset_rows_are_prompts_and_a_dict_without_prompt_is_named():
    """`run(target, load_prompts(...))` reads each row's "prompt" (a row once failed as "prompt[0] = 'id' is not an
    integer token id"); a dict without one is refused naming its keys."""
    from specbench.api import encode_prompts
    from tests.tokenizers_for_tests import byte_level_bpe

    tokenizer = byte_level_bpe()
    row = {"id": "refine-1", "set": "self-refine", "prompt": "Describe a gear.", "turns": ["Describe a gear."]}
    assert encode_prompts([row, [5, 6]], tokenizer, chat=False) == encode_prompts(["Describe a gear.", [5, 6]],
                                                                                  tokenizer, chat=False)
    with pytest.raises(SpecbenchError, match=r"prompt 1 is a dict without a 'prompt' text \(keys \['id', 'turns'\]"):
        encode_prompts([[1], {"id": 3, "turns": ["a"]}], tokenizer)


def test_tree_budget_zero_and_dynamic_tree_with_rejection(tiny_target, tiny_draft):
    from specbench.decode.tree_drafters import TreeDrafter

    drafter = TreeDrafter(tiny_draft, 96)
    with pytest.raises(SpecbenchError, match="budget must be >= 1"):
        drafter.propose([1, 2, 3], 0, SamplingParams(), torch.Generator())
    with pytest.raises(SpecbenchError, match="sample-match"):
        drafter.propose([1, 2, 3], 8, SamplingParams(temperature=1.0, rule="rejection"), torch.Generator())
    with pytest.raises(SpecbenchError, match="widths"):
        TreeDrafter(tiny_draft, 96, widths=(2, 0))


def test_tree_deeper_than_context_is_refused(tiny_target):
    target = LocalTarget(tiny_target, max_context=8)
    target.prefill("s", [1, 2, 3, 4, 5])
    with pytest.raises(SpecbenchError, match="exceeds the target's context of 8"):
        target.verify("s", DraftTree.chain([1, 2, 3, 4]), SamplingParams(), 0)


def test_prompt_lookup_tree_merges_candidates():
    tree = PromptLookupDrafter(max_ngram=1, max_candidates=3).propose(
        [7, 1, 7, 2, 7, 1, 9, 7], 4, SamplingParams(), torch.Generator())
    # continuations after each earlier 7: [1, 9, 7], [2, 7, 1], [1, 7, 2] -> trie with shared prefix 1
    assert tree.tokens == (1, 9, 7, 2) and tree.parents == (-1, 0, 1, -1)


def test_each_method_may_run_at_its_own_k_in_one_call(tiny_target, tiny_draft):
    """"chain:2" beside "prompt-lookup:3" in one interleaved call: each method's rows carry its own K and draft at
    most that many tokens a step, outputs stay target-only's; a method given twice, or a K that is not a whole
    number, is refused by name."""
    from specbench.api import outputs

    prompts = [[1, 2, 3, 4, 1, 2, 3], [9, 10, 11, 12, 9, 10]]
    got = run(tiny_target, prompts, method=["target-only", "prompt-lookup:3", "chain:2"], draft=tiny_draft, k=5,
              max_new_tokens=12, progress=False, warmup=False)
    assert got.groupby("method")["k"].max().to_dict() == {"target-only": 0, "prompt-lookup": 3, "chain": 2}
    assert got[got.method == "chain"]["drafted"].max() == 2 and got[got.method == "prompt-lookup"]["drafted"].max() <= 3
    produced = outputs(got)
    assert all(produced[(m, i)] == produced[("target-only", i)] for m in ("prompt-lookup", "chain") for i in (0, 1))
    with pytest.raises(SpecbenchError, match="'chain' is given twice"):
        run(tiny_target, prompts, method=["chain:2", "chain:4"], draft=tiny_draft, progress=False)
    with pytest.raises(SpecbenchError, match="K after ':' must be a whole number"):
        run(tiny_target, prompts, method=["chain:two"], draft=tiny_draft, progress=False)
    with pytest.raises(SpecbenchError, match="name a draft after '@'"):
        run(tiny_target, prompts, method=["chain:2@"], draft=tiny_draft, progress=False)
    with pytest.raises(SpecbenchError, match="'chain@mine' is given twice"):
        run(tiny_target, prompts, method=["chain:2@mine", "chain:4@mine"], drafts={"mine": tiny_draft}, progress=False)


def test_one_call_compares_two_drafts_of_one_method(tiny_target, tiny_draft):
    """"chain:2" with `draft` beside "chain:2@far" with its own: rows labelled apart, each drafting with its own
    model (the far draft accepts less), both outputs target-only's; a draft name that is no key of `drafts` is
    loaded as a model name, and one that is no model is refused naming it."""
    from specbench.api import outputs
    from specbench.models.tiny import tiny_model

    prompts = [[1, 2, 3, 4, 1, 2, 3], [9, 10, 11, 12, 9, 10]]
    far = tiny_model(seed=1, noise_from=tiny_target, noise_scale=0.05)
    got = run(tiny_target, prompts, method=["target-only", "chain:2", "chain:2@far"], draft=tiny_draft,
              drafts={"far": far}, max_new_tokens=16, progress=False, warmup=False)
    assert list(dict.fromkeys(got["method"])) == ["target-only", "chain", "chain@far"]
    accepted = got.groupby("method")["accepted"].mean()
    assert accepted["chain"] > accepted["chain@far"]
    produced = outputs(got)
    assert all(produced[(m, i)] == produced[("target-only", i)] for m in ("chain", "chain@far") for i in (0, 1))
    with pytest.raises(SpecbenchError, match="no-such-draft"):
        run(tiny_target, prompts, method=["chain:2@no-such-draft"], progress=False, warmup=False)
    with pytest.raises(SpecbenchError, match="drafts with its own: run it without planner"):
        run(tiny_target, prompts, method=["chain:2@far"], drafts={"far": far}, planner=object(), progress=False)


@pytest.mark.parametrize("grid,words", [
    ({"tokens": [0], "contexts": [8]}, "must all be >= 1, got 5, \\[0\\]"),
    ({"tokens": [1], "contexts": [-5]}, "must all be >= 1"),
    ({"tokens": [4], "contexts": [10**6]}, "passes the model's .* positions"),
])
def test_a_profile_grid_that_cannot_be_measured_is_refused_by_name(tiny_target, grid, words):
    """`specbench profile --tokens 0` printed a ValueError traceback; a context past the model's positions
    ran for minutes (SmolLM2, --contexts 100000) and measured a point no prompt can reach."""
    from specbench.decode.profile import forward_latency_grid

    with pytest.raises(SpecbenchError, match=words):
        forward_latency_grid(tiny_target.model, repeats=5, **grid)


def test_run_reads_one_text_as_one_prompt_and_refuses_what_is_no_prompt_list(tiny_target):
    """An outside tester's calls: `run(t, "def f():")` ran one prompt per character (8 prompts); `k="3"`,
    `method=[]`, `method=None` and `prompts=[None]` raised TypeError or ZeroDivisionError; `k=2.5` ran;
    `prompts=[]` returned an empty frame unsaid; a flat list of ids failed in `list(1)`; `seed="a"` met torch's
    OverflowError ("cannot fit 'int' into an index-sized integer")."""
    from specbench.api import outputs

    ids = run(tiny_target, [(1, 2, 3)], method="target-only", max_new_tokens=3, progress=False, warmup=False)
    assert len(outputs(ids)) == 1
    for changes, words in (({"k": "3"}, "k must be a whole number"), ({"k": 2.5}, "k must be a whole number"),
                           ({"method": []}, "method must name"), ({"method": None}, "method must name"),
                           ({"prompts": []}, "no prompts to run"), ({"prompts": [None]}, "prompt 0 is None"),
                           ({"prompts": [1, 2, 3]}, "one list of 3 integers"), ({"seed": "a"}, "seed must be a whole"),
                           ({"seed": 1.5}, "seed must be a whole")):
        call = {"prompts": [[1, 2, 3]], "method": "prompt-lookup", "k": 2, **changes}
        with pytest.raises(SpecbenchError, match=words):
            run(tiny_target, call.pop("prompts"), max_new_tokens=3, progress=False, warmup=False, **call)


def test_one_text_is_one_prompt(smollm2):
    """(the tiny models have no tokenizer: SmolLM2's)"""
    from specbench.api import outputs

    records = run(smollm2, "def f():", method="target-only", max_new_tokens=3, progress=False, warmup=False)
    assert list(outputs(records)) == [("target-only", 0)]
