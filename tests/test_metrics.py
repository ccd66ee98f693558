"""Metrics from step records: where in its reply a step drafted, and tokens per step along replies."""
import pandas as pd

from specbench.decode.metrics import reply_position, tokens_per_step_by_position


def _steps(method: str, prompt: int, accepted: list[int]) -> list[dict]:
    return [dict(method=method, prompt_index=prompt, step=i, accepted=a, emitted=a + 1) for i, a in enumerate(accepted)]


def test_a_steps_reply_position_counts_its_own_replys_earlier_tokens_whatever_the_row_order():
    rows = _steps("suffix", 0, [0, 3, 1]) + _steps("suffix", 1, [2, 0]) + _steps("target-only", 0, [0, 0, 0])
    records = pd.DataFrame(rows).sample(frac=1.0, random_state=3)  # rows out of order, as concatenated runs may be
    before = reply_position(records)
    expected = {("suffix", 0): [0, 1, 5], ("suffix", 1): [0, 3], ("target-only", 0): [0, 1, 2]}
    for (method, prompt), positions in expected.items():
        mine = records[(records["method"] == method) & (records["prompt_index"] == prompt)]
        assert before[mine.sort_values("step").index].tolist() == positions


def test_tokens_per_step_by_position_bins_steps_by_where_their_reply_stood():
    # suffix, prompt 0: steps begin at tokens 0, 1, 5, 9 (accepted 0, 3, 3, 0); prompt 1 at 0, 5 (accepted 4, 1)
    records = pd.DataFrame(_steps("suffix", 0, [0, 3, 3, 0]) + _steps("suffix", 1, [4, 1])
                           + _steps("target-only", 0, [0] * 10))
    table = tokens_per_step_by_position(records, width=4)
    assert list(table.columns) == ["0-3", "4-7", "8-11"]
    assert table.loc["suffix", "0-3"] == (1 + 4 + 5) / 3  # the steps at 0, 1 and prompt 1's at 0
    assert table.loc["suffix", "4-7"] == (4 + 2) / 2  # prompt 0's at 5, prompt 1's at 5
    assert table.loc["suffix", "8-11"] == 1.0
    assert (table.loc["target-only"] == 1.0).all()
