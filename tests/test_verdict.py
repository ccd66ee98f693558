"""The sentence a notebook prints about why a method won or lost: computed from records, as documented."""
import pandas as pd

from specbench.decode.verdict import rtt_order_note, speed_verdicts


def _records(draft_s: float, accepted: list[int], verify_s: float = 0.065, network_s: float = 0.0, rtt: int = 0):
    rows = [dict(method="target-only", kind="none", drafted=0, accepted=0, emitted=1, draft_s=0.0,
                 target_forward_s=0.05, network_s=network_s, step_s=0.05 + network_s, emulated_rtt_ms=rtt)
            for _ in accepted]
    rows += [dict(method="chain", kind="chain", drafted=4, accepted=a, emitted=a + 1, draft_s=draft_s,
                  target_forward_s=verify_s, network_s=network_s, step_s=draft_s + verify_s + network_s,
                  emulated_rtt_ms=rtt) for a in accepted]
    return pd.DataFrame(rows)


def test_the_module_docstring_example():
    """t = 50 ms, c = 40 ms a drafted token, v = 1.3, K = 4, 2.2 tokens per step: 0.49x; it would pay
    with drafting under (2.2 x 50 - 65) / 4 = 11.25 ms a token, 0.22 of a forward."""
    [sentence] = speed_verdicts(_records(0.16, [1, 1, 1, 2, 1]))
    assert sentence.startswith("chain is 0.49x target-only, slower, because each drafted token costs 0.80 of a "
                               "target forward, a verify 1.30 of one, and a step returns 2.20 tokens for 4.0 drafted")
    assert "drafting under 0.23 of a target forward per token" in sentence
    assert "or 4.50 tokens per step (of at most 5)" in sentence


def test_a_draft_whose_length_varies_is_bounded_by_its_mean_length_plus_one():
    """Prompt lookup drafts 4 tokens where it finds a match and none elsewhere: at most 1 + 2.4 a step on average."""
    records = _records(0.0, [0, 0, 0, 0, 0], verify_s=0.06)
    records.loc[records["kind"] == "chain", "drafted"] = [4, 0, 4, 4, 0]
    [sentence] = speed_verdicts(records)
    assert "(of at most 3.4)" in sentence, sentence


def test_a_draft_too_dear_for_any_acceptance_and_a_winner():
    [dear] = speed_verdicts(_records(0.2, [3, 4, 3, 4]))
    assert "no acceptance pays" in dear and "more than the 5 it can" in dear
    [cheap] = speed_verdicts(_records(0.01, [3, 4, 3, 4]))
    assert cheap.startswith("chain is 3.") and "slower" not in cheap


def test_rtt_order_note_tells_noise_from_a_trend():
    steady = pd.concat([_records(0.16, [1, 1], network_s=rtt / 1000, rtt=rtt) for rtt in (0, 10, 100)])
    assert speed_verdicts(steady, by="emulated_rtt_ms")[0].startswith("chain at emulated_rtt_ms 0 is")
    assert rtt_order_note(steady).startswith("target-only slowed as the RTT grew")
    noisy = steady.copy()
    noisy.loc[(noisy["kind"] == "none") & (noisy["emulated_rtt_ms"] == 10), "step_s"] = 0.3
    assert rtt_order_note(noisy).startswith("noise: target-only ran faster at a larger RTT")


def test_a_hybrids_verdict_says_how_its_steps_split_between_suffix_decoding_and_its_draft():
    """Suffix decoding took 2 steps (4 and 2 tokens), the draft 3 (2, 1, 2): the sentence says so, so a reader sees
    which half to tune; a plain chain's sentence is unchanged."""
    records = _records(0.01, [3, 1, 1, 0, 1])
    records["draft_source"] = [""] * 5 + ["suffix", "suffix", "other", "other", "other"]
    [sentence] = speed_verdicts(records)
    assert ("(suffix decoding drafted 2 of 5 steps (3.00 tokens a step), the draft 3 of 5 steps (1.67 tokens a "
            "step))") in sentence, sentence
    [plain] = speed_verdicts(_records(0.01, [3, 1, 1, 0, 1]))
    assert "suffix decoding" not in plain
