"""Where an output leaves target-only's and whether the target nearly tied there (the bf16 near-tie check)."""
import pandas as pd
import pytest
import torch

from specbench.api import divergences, outputs, run
from specbench.decode.divergence import divergence, first_difference
from specbench.types import SpecbenchError

PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]


def _logits_after(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_first_difference_counts_an_output_that_ended():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], [4]) == 0


def test_a_swap_to_the_runner_up_is_a_near_tie_only_within_the_tolerance(tiny_target):
    """The share reported is the target's own logit gap at the swap, and the verdict follows the tolerance."""
    expected = outputs(run(tiny_target, PROMPTS[:1], method="target-only", max_new_tokens=8, progress=False))[
        ("target-only", 0)]
    at = 3
    logits = _logits_after(tiny_target.model, PROMPTS[0] + expected[:at])
    first, second = torch.topk(logits, 2).indices.tolist()
    assert first == expected[at]  # greedy
    got = expected[:at] + [second] + expected[at + 1:]
    share = float(logits[first] - logits[second]) / float(logits.max() - logits.min())
    found = divergence(tiny_target.model, PROMPTS[0], expected, got, tolerance=share * 1.01)
    assert (found.position, found.expected_token, found.got_token) == (at, first, second)
    assert found.expected_logit == pytest.approx(float(logits[first]), abs=1e-5)
    assert found.share_of_range == pytest.approx(share, rel=1e-5) and found.near_tie
    assert not divergence(tiny_target.model, PROMPTS[0], expected, got, tolerance=share * 0.99).near_tie
    far = int(torch.argmin(logits))  # the target's least likely token: never a tie
    assert not divergence(tiny_target.model, PROMPTS[0], expected, expected[:at] + [far]).near_tie
    assert divergence(tiny_target.model, PROMPTS[0], expected, list(expected)) is None
    stopped = divergence(tiny_target.model, PROMPTS[0], expected, expected[:at])
    assert stopped.position == at and stopped.got_token is None and stopped.near_tie is None


def test_divergences_of_a_run_find_the_changed_output_and_nothing_else(tiny_target, tiny_draft):
    records = run(tiny_target, PROMPTS, method=["target-only", "chain"], draft=tiny_draft, k=3, max_new_tokens=10,
                  progress=False)
    assert divergences(records, tiny_target, PROMPTS).empty  # fp32: lossless, token for token
    # one emitted token of chain on prompt 1 replaced by the target's least likely token there
    chain = records[(records["method"] == "chain") & (records["prompt_index"] == 1)].sort_values("step")
    row = chain.index[1]
    expected = outputs(records)[("target-only", 1)]
    at = len(chain.loc[chain.index[0], "emitted_tokens"])
    worst = int(torch.argmin(_logits_after(tiny_target.model, PROMPTS[1] + expected[:at])))
    changed = records.copy()
    changed.at[row, "emitted_tokens"] = [worst] + list(changed.at[row, "emitted_tokens"])[1:]
    found = divergences(changed, tiny_target, PROMPTS)
    assert found[["method", "prompt_index", "position", "expected_token", "got_token"]].values.tolist() == [
        ["chain", 1, at, expected[at], worst]]
    assert not found["near_tie"].iloc[0] and found["share_of_range"].iloc[0] == pytest.approx(1.0)
    # the reference can come from another frame (a remote run checked against a local one)
    remote_like = changed[changed["method"] == "chain"]
    assert divergences(remote_like, tiny_target, PROMPTS, reference=records)["position"].tolist() == [at]


def test_divergences_refuse_a_target_without_local_weights():
    with pytest.raises(SpecbenchError, match="weights in this process"):
        divergences(pd.DataFrame(columns=["method", "prompt_index", "step", "emitted_tokens"]), object(), PROMPTS)


def test_the_demo_names_each_difference_a_near_tie_or_a_defect(tiny_target, tiny_draft):
    from specbench.decode.divergence import difference_lines
    from specbench.demo import _divergences

    def _differences(target, records, reference, prompts):
        return difference_lines(_divergences(target, records, reference, prompts), "float32")

    records = run(tiny_target, PROMPTS, method=["target-only", "chain"], draft=tiny_draft, k=3, max_new_tokens=10,
                  progress=False).assign(where="local")
    assert _differences(tiny_target, records, records, PROMPTS) == ["every output is target-only's, token for token"]
    chain = records[(records["method"] == "chain") & (records["prompt_index"] == 0)].sort_values("step")
    expected = outputs(records)[("target-only", 0)]
    logits = _logits_after(tiny_target.model, PROMPTS[0] + expected[:len(chain.iloc[0]["emitted_tokens"])])
    changed = records.copy()
    runner_up = int(torch.topk(logits, 2).indices[1])
    for token, verdict in ((int(torch.argmin(logits)), "NOT a near-tie"), (runner_up, None)):
        changed.at[chain.index[1], "emitted_tokens"] = [token] + list(chain.iloc[1]["emitted_tokens"])[1:]
        lines = _differences(tiny_target, changed, records, PROMPTS)
        assert len(lines) == 2 and lines[1].startswith("  local chain, prompt 0, token ")
        share = float(logits.max() - logits[token]) / float(logits.max() - logits.min())
        expected_verdict = verdict or ("a near-tie" if share <= 0.02 else "NOT a near-tie")
        assert expected_verdict in lines[1], (share, lines[1])


def test_the_run_command_says_why_and_whether_outputs_match(capsys):
    from specbench.cli import main

    assert main(["run", "--target", "smollm2-135m", "--method", "target-only", "prompt-lookup", "--prompt",
                 "Say hello three times: hello hello hello", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "prompt-lookup is " in printed and "x target-only" in printed  # the verdict
    assert "every output is target-only's, token for token" in printed


def test_the_run_command_checks_sample_match_outputs_against_target_only(capsys, tmp_path):
    """Under sample-match the seed fixes each position's draw, so sampled outputs are checked like greedy ones
    (one seed, one text), and --seed is what fixes it; a sampled run under rejection prints no such line."""
    import pandas as pd

    from specbench.cli import main

    texts = []
    for seed in ("4", "5"):
        out = tmp_path / f"seed-{seed}.csv"
        assert main(["run", "--target", "smollm2-135m", "--method", "target-only", "prompt-lookup", "--prompt",
                     "Say hello three times: hello hello hello", "--max-new-tokens", "12", "--temperature", "1.0",
                     "--rule", "sample-match", "--seed", seed, "--out", str(out)]) == 0
        assert "every output is target-only's, token for token" in capsys.readouterr().out
        records = pd.read_csv(out)
        texts.append(records[records["method"] == "target-only"]["emitted_tokens"].tolist())
    assert texts[0] != texts[1]
    assert main(["run", "--target", "smollm2-135m", "--method", "target-only", "--prompt", "Hi", "--max-new-tokens",
                 "2", "--temperature", "1.0"]) == 0  # rejection, the default at a temperature: no identity line
    printed = capsys.readouterr().out
    assert "token for token" not in printed and "verified by rejection" in printed  # the rule it was not told
    # a dynamic tree has no rejection rule: the default is sample-match, and said (before: an error after loading)
    assert main(["run", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--method", "target-only", "tree",
                 "--prompt", "Hi", "--max-new-tokens", "6", "--temperature", "1.0"]) == 0
    printed = capsys.readouterr().out
    assert "verified by sample-match" in printed and "every output is target-only's, token for token" in printed


def test_the_run_command_against_a_worker_on_a_dataset(capsys, tmp_path):
    """`specbench run --worker ENDPOINT --prompts JSONL --prompt-count N`: the prompts are the file's (a seeded
    sample), the target is the worker's model (its tokenizer comes from it), and greedy outputs are checked
    against target-only's."""
    import json

    from specbench.cli import main
    from specbench.models.spec import ModelSpec
    from worker_helpers import ThreadWorker

    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": text, "set": "mine"}) + "\n" for text in (
        "Say hello three times: hello hello hello", "Count: 1 2 3 4", "Name a colour.")))
    running = ThreadWorker(model=ModelSpec("smollm2-135m"), draft=None)
    try:
        assert main(["run", "--worker", running.endpoint, "--prompts", str(path), "--prompt-count", "2", "--method",
                     "target-only", "prompt-lookup", "--max-new-tokens", "8"]) == 0
    finally:
        running.stop()
    printed = capsys.readouterr().out
    assert "prompt-lookup is " in printed and "every output is target-only's, token for token" in printed
    assert sum(line.split()[:1] == ["target-only"] and line.split()[1] == "16" for line in printed.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--prompts", "humaneval"], "--prompt and --prompts both name the prompts"),
    (["--prompt-count", "3"], "--prompt-count samples a --prompts dataset"),
    (["--curve-keys", "keys/"], "--curve-keys are a worker client's keys"),
    (["--worker", "tcp://127.0.0.1:9", "--quant", "int8-dynamic"], "--quant with --worker needs --target"),
    (["--worker", "tcp://127.0.0.1:9", "--plan", "--kernels", "tuned"],
     "--kernels, --plan with --worker need --target"),
])
def test_the_run_command_refuses_options_that_would_do_nothing(capsys, argv, message):
    from specbench.cli import main

    assert main(["run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_remote_differences_name_each_output_that_left_target_only(monkeypatch):
    import specbench.api
    from specbench.run_command import _remote_differences

    monkeypatch.setattr(specbench.api, "outputs", lambda records: {("target-only", 0): [1, 2], ("chain", 0): [1, 2],
                                                                   ("target-only", 1): [3], ("chain", 1): [4]})
    line = _remote_differences(None)
    assert line.startswith("outputs that left target-only's (chain prompt 1)")
    monkeypatch.setattr(specbench.api, "outputs", lambda records: {("target-only", 0): [1], ("chain", 0): [1]})
    assert _remote_differences(None) == "every output is target-only's, token for token"
