"""A hybrid's hand-over chosen from a calibration run: the replay takes a real run's steps, one for one."""
import pandas as pd
import pytest

from specbench.api import outputs, run
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.route.hand_over import choose_hand_over, replay_hand_overs
from specbench.route.suffix_floor import StepCost
from specbench.types import SpecbenchError

from conftest import PROMPTS

REPEATING = PROMPTS + [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [11]]


@pytest.mark.parametrize("tree", [False, True])
def test_the_replay_takes_the_steps_a_real_hybrid_run_takes(tiny_target, tiny_draft, tree):
    """Greedy: suffix decoding's proposals depend on the context and its cache, the draft's on the prefix, so
    replaying target-only's outputs gives the hybrid run's own steps and verified tokens at each hand-over."""
    method = "suffix-tree-chain" if tree else "suffix-chain"
    base = run(tiny_target, REPEATING, method="target-only", max_new_tokens=24, progress=False, warmup=False)
    produced = outputs(base)
    answers = [produced[("target-only", i)] for i in range(len(REPEATING))]
    cost = StepCost(0.06, 0.004, 0.0)
    for hand_over in (0.5, 2.0):
        settings = SuffixSettings(cache="drafter", hand_over=hand_over, other_k=3)
        records = run(tiny_target, REPEATING, method=method, draft=tiny_draft, k=8, max_new_tokens=24, progress=False,
                      warmup=False, suffix=settings)
        table = replay_hand_overs(REPEATING, answers, tiny_draft, settings, cost, 0.01, k=8, tree=tree,
                                  hand_overs=[hand_over])
        row = table.iloc[0]
        assert row["steps"] == len(records) and row["tokens"] == records["emitted"].sum()
        assert row["verified"] == len(records) + records["drafted"].sum()
    with pytest.raises(SpecbenchError, match="one output per prompt"):
        replay_hand_overs(REPEATING, answers[:2], tiny_draft, SuffixSettings(), cost, 0.01)


def test_the_choice_follows_the_price_of_a_model_step(tiny_target, tiny_draft):
    """A model step that costs nothing extra makes handing more steps to the model no worse; one that costs a
    great deal makes the lowest hand-over (suffix decoding wherever it finds anything) the choice."""
    base = run(tiny_target, REPEATING, method=["target-only", "suffix"], max_new_tokens=24, k=8, progress=False,
               warmup=False, suffix=SuffixSettings(cache="drafter"))
    answers = [outputs(base)[("target-only", i)] for i in range(len(REPEATING))]
    chain = pd.DataFrame({"method": ["chain"] * 3, "drafted": [3] * 3, "step_s": [0.1] * 3, "draft_s": [50.0] * 3,
                          "emitted": [1] * 3})
    dear, table = choose_hand_over(REPEATING, answers, pd.concat([base, chain]), tiny_draft,
                                   SuffixSettings(other_k=3), k=8, hand_overs=(0.5, 2.0, 1e9))
    assert dear == 0.5 and table["chosen"].sum() == 1
    assert table["model_steps"].is_monotonic_increasing and table["model_steps"].iloc[0] < table["steps"].iloc[0]
    with pytest.raises(SpecbenchError, match="draft model's own chain"):
        choose_hand_over(REPEATING, answers, base, tiny_draft)
