"""chain-confident: a draft model's chain that ends after a token its draft was unsure of (Hugging Face's
assisted generation's default rule). The stop may change only how far a chain goes: greedy output stays
target-only's, sampled output keeps the target's distribution, and a chain ends exactly at its first unsure token."""
import pytest
import torch

from specbench.api import outputs, run
from specbench.decode.drafters import ModelDrafter
from specbench.decode.loop import Decoding
from specbench.decode.target import LocalTarget
from specbench.methods import DraftSource, make_drafter
from specbench.models.tiny import tiny_model
from specbench.types import SamplingParams, SpecbenchError

from conftest import PROMPTS
from test_distributions import LOOKUP_PROMPT, SAMPLING_LAYERS, check_two_token_marginals

GREEDY = SamplingParams()
CONTEXTS = ([1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12], [3, 3, 3], [20, 21, 22, 23], [5, 9, 2, 40, 41])


def own_probabilities(draft, context, tokens) -> list[float]:
    """The draft's own probability of each token of a chain, teacher-forced in one forward."""
    with torch.no_grad():
        logits = draft.model(torch.tensor([context + tokens])).logits[0].float()
    probs = torch.softmax(logits, -1)
    return [float(probs[len(context) - 1 + i, token]) for i, token in enumerate(tokens)]


def test_a_chain_ends_at_its_first_unsure_token(tiny_draft):
    """Against a full chain of the same draft: the same tokens up to the first one the draft gave less than
    the threshold, that one included, none after it; all K when none is unsure. Both outcomes must occur."""
    stop_below, k = 0.09, 8
    plain = ModelDrafter(tiny_draft, tiny_draft.vocab_size)
    confident = ModelDrafter(tiny_draft, tiny_draft.vocab_size, stop_below=stop_below)
    lengths = []
    for context in CONTEXTS:
        full = list(plain.propose(context, k, GREEDY, torch.Generator()).tokens)
        probs = own_probabilities(tiny_draft, context, full)
        unsure = next((i for i, p in enumerate(probs) if p < stop_below), None)
        expected = k if unsure is None else unsure + 1
        got = confident.propose(context, k, GREEDY, torch.Generator())
        assert list(got.tokens) == full[:expected], (context, probs)
        assert len(got.draft_dists) == len(got.tokens)
        lengths.append(expected)
    assert k in lengths and min(lengths) < k, lengths  # full chains and stopped ones


def test_greedy_output_is_target_only_output_and_chains_vary_in_length(tiny_target, tiny_draft):
    k = 6
    records = run(tiny_target, PROMPTS, method=["target-only", "chain", "chain-confident"], draft=tiny_draft, k=k,
                  max_new_tokens=40, progress=False, stop_below=0.12)
    produced = outputs(records)
    for method in ("chain", "chain-confident"):
        for index in range(len(PROMPTS)):
            assert produced[(method, index)] == produced[("target-only", index)], (method, index)
    confident = records[records.method == "chain-confident"]
    full = records[records.method == "chain"]
    assert 0 < confident["accepted"].sum() < confident["drafted"].sum()
    drafted = confident["drafted"][confident["drafted"] > 0]  # steps near the end draft to the tokens left
    assert drafted.min() < k and drafted.max() == k
    assert confident["drafted"].sum() < full["drafted"].sum()


def test_no_threshold_drafts_what_the_chain_drafts(tiny_target, tiny_draft):
    records = run(tiny_target, PROMPTS[:2], method=["chain", "chain-confident"], draft=tiny_draft, k=4,
                  max_new_tokens=24, progress=False, stop_below=0.0)
    by_method = records.groupby("method")["drafted"].apply(list)
    assert by_method["chain"] == by_method["chain-confident"]


@pytest.mark.parametrize("rule", ["rejection", "sample-match"])
def test_sampled_chains_keep_the_targets_two_token_marginals(rule):
    """The stop depends only on what was drafted, so every position is verified as before: chi-square on the
    first two emitted tokens of 1,500 seeded generations, with chains both stopped and full."""
    vocab, k = 16, 3
    target = tiny_model(seed=3, vocab_size=vocab, num_layers=SAMPLING_LAYERS)
    draft = tiny_model(seed=4, vocab_size=vocab, noise_from=target, noise_scale=0.01, num_layers=SAMPLING_LAYERS)
    local = LocalTarget(target)
    drafter = make_drafter("chain-confident", DraftSource(local, target, draft, stop_below=STOP_SAMPLED))
    stopped = []
    propose = drafter.propose

    def counted(context, budget, sampling, draws, max_depth=None):
        tree = propose(context, budget, sampling, draws, max_depth=max_depth)
        if min(budget, max_depth or budget) >= 2:  # a chain that could have gone on
            stopped.append(len(tree.tokens) < min(budget, max_depth or budget))
        return tree

    drafter.propose = counted
    sampling = SamplingParams(temperature=1.5, rule=rule, draft_top_k=8)
    # 3 new tokens: the first step may draft 2, so a stop after the first changes what the first two tokens meet
    check_two_token_marginals(local, target, drafter, Decoding(k, 3, sampling), vocab, prompt=LOOKUP_PROMPT)
    share = sum(stopped) / len(stopped)
    assert 0.2 < share < 0.8, share


STOP_SAMPLED = 0.2  # the draft gives its first token at least this about half the time on LOOKUP_PROMPT


def test_a_threshold_outside_zero_to_one_is_refused():
    draft = tiny_model(seed=1, num_layers=1)
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(SpecbenchError, match="stop_below is a probability"):
            ModelDrafter(draft, draft.vocab_size, stop_below=bad)
    with pytest.raises(SpecbenchError, match="stop_below is a probability"):  # before the (missing) model loads
        run("no-such-model-anywhere", [[1, 2]], method="chain-confident", draft="no-such-draft", stop_below=1.5)


def test_the_cli_runs_it_on_smollm2_and_its_output_is_target_onlys(tmp_path, capsys):
    """A real model in fp32 (its own 8-bit copy drafting): every output target-only's token for token, and the
    chains' lengths vary with the draft's confidence."""
    import pandas as pd

    from specbench.cli import main

    out = tmp_path / "records.csv"
    assert main(["run", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--draft-quant", "8bit",
                 "--prompt", "Write a haiku about the sea.", "--prompt", "def fibonacci(n):",
                 "--method", "target-only", "chain-confident", "--k", "8", "--stop-below", "0.6",
                 "--max-new-tokens", "32", "--out", str(out)]) == 0
    assert "every output is target-only's, token for token" in capsys.readouterr().out
    records = pd.read_csv(out)
    drafted = records[(records.method == "chain-confident") & (records.drafted > 0)]["drafted"]
    assert drafted.nunique() > 1 and drafted.max() <= 8, drafted.tolist()  # chains end where the draft is unsure
