"""Suffix decoding's floor chosen from a calibration run: the step cost fit, the replay against a real run,
and the choice following the cost."""
import random

import pandas as pd
import pytest

from specbench.api import outputs, run
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.route.suffix_floor import StepCost, choose_min_score, fit_step_cost, replay_floors
from specbench.types import SpecbenchError

from conftest import PROMPTS

# a workload that repeats itself: the later requests resend most of an earlier one's text
REPEATING = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [30, 31, 32, 1, 2, 3, 4, 5]]
OUTPUTS = [[11, 12, 13, 14, 15, 16, 17, 18], [12, 13, 14, 15, 16, 17, 50, 51], [6, 7, 8, 9, 10, 11, 12, 99]]


def test_the_step_cost_fit_recovers_a_known_cost_and_refuses_records_it_cannot_fit():
    cost = StepCost(0.060, 0.004, 0.025)
    drafted = [0, 0, 1, 2, 4, 8, 0, 3, 16, 5]
    records = pd.DataFrame({"drafted": drafted,
                            "step_s": [cost.seconds(1, 1 + d, int(d > 0)) for d in drafted]})
    found = fit_step_cost(records)
    for name in ("fixed_s", "per_verified_token_s", "drafted_surcharge_s"):
        assert getattr(found, name) == pytest.approx(getattr(cost, name), abs=1e-9)
    for only in ([0, 0, 0, 0], [1, 2, 3, 4]):  # the surcharge is not separable from the fixed cost
        with pytest.raises(SpecbenchError, match="steps that drafted and steps that did not"):
            fit_step_cost(pd.DataFrame({"drafted": only, "step_s": [0.1] * len(only)}))


def test_a_fit_that_prices_a_verified_token_below_zero_holds_it_at_zero():
    """Noise can tilt the free fit to a negative per-token cost (longer verifies "cheaper"); the fit then holds
    that cost at 0 and refits the fixed cost and the surcharge (here: 0.10 s, and the drafted steps' mean over it)."""
    records = pd.DataFrame({"drafted": [0, 1, 4], "step_s": [0.10, 0.12, 0.11]})
    found = fit_step_cost(records)
    assert found.per_verified_token_s == 0.0
    assert found.fixed_s == pytest.approx(0.10, abs=1e-9) and found.drafted_surcharge_s == pytest.approx(0.015, abs=1e-9)


def test_the_fit_leaves_out_a_model_drafts_steps_and_holds_a_negative_surcharge_at_zero():
    """A chain's steps hold its draft's forwards (here 0.5 s a step): counted, they would pass for a surcharge on
    every drafted step. Left out, the lookup's and target-only's steps give the verify's own cost; a width that
    costs less than the line through the others says "no surcharge", not a negative one."""
    cost = StepCost(0.060, 0.004, 0.0)
    lookup = [0, 0, 1, 2, 4, 8, 0, 3, 16, 5]
    records = pd.DataFrame({"method": ["target-only" if d == 0 else "suffix" for d in lookup] + ["chain"] * 4,
                            "drafted": lookup + [3] * 4,
                            "step_s": [cost.seconds(1, 1 + d, int(d > 0)) for d in lookup] + [0.56] * 4})
    found = fit_step_cost(records)
    assert found.fixed_s == pytest.approx(0.060) and found.per_verified_token_s == pytest.approx(0.004)
    assert found.drafted_surcharge_s == pytest.approx(0.0, abs=1e-9)
    cheaper = records[records.method != "chain"].assign(
        step_s=lambda d: d.step_s - 0.01 * (d.drafted > 0))  # drafted steps 10 ms under the line
    held = fit_step_cost(cheaper)
    assert held.drafted_surcharge_s == 0.0 and held.per_verified_token_s > 0


def test_replayed_floors_keep_every_token_and_draft_less_as_the_floor_rises():
    cost = StepCost(0.060, 0.004, 0.025)
    table = replay_floors(REPEATING, OUTPUTS, SuffixSettings(min_prob=0.0, factor=2.0, offset=1.0), cost,
                          floors=(0.0, 1.0, 2.0, 1000.0))
    assert (table["tokens"] == sum(map(len, OUTPUTS))).all()
    assert table["drafting_steps"].is_monotonic_decreasing and table["drafting_steps"].iloc[0] > 0
    assert table["tokens_per_step"].iloc[0] > 1.0  # the repeats are drafted and accepted
    last = table.iloc[-1]  # nothing expects 1000 tokens: the target's steps alone
    assert last["drafting_steps"] == 0 and last["steps"] == last["tokens"] == last["verified"]
    with pytest.raises(SpecbenchError, match="one output per prompt"):
        replay_floors(REPEATING, OUTPUTS[:2], SuffixSettings(), cost)


@pytest.mark.parametrize("min_score", [0.0, 1.0])
def test_the_replay_takes_the_steps_a_real_run_takes(tiny_target, min_score):
    """Greedy: the drafter's proposals depend on the context and on what its cache saw, so replaying the
    target-only outputs gives the suffix run's own steps, drafted steps and verified tokens, one for one."""
    settings = SuffixSettings(cache="drafter", factor=2.0, offset=1.0, min_score=min_score)
    records = run(tiny_target, PROMPTS, method=["target-only", "suffix"], k=8, max_new_tokens=40, progress=False,
                  suffix=settings, warmup=False)
    produced = outputs(records)
    table = replay_floors(PROMPTS, [produced[("target-only", i)] for i in range(len(PROMPTS))], settings,
                          StepCost(1.0, 0.0, 0.0), k=8, floors=(min_score,))
    steps = records[records.method == "suffix"]
    assert table["steps"].iloc[0] == len(steps)
    assert table["drafting_steps"].iloc[0] == (steps["drafted"] > 0).sum() > 0
    assert table["verified"].iloc[0] == (steps["drafted"] + 1).sum()


def test_the_chosen_floor_follows_the_price_of_a_drafted_step():
    """Free drafting (a step costs the same whatever it verifies): the floor stays 0. A dear drafted step (as float32 on an AVX2 CPU):
    a floor that skips the doubtful drafts wins."""
    drafted = [0, 0, 1, 2, 4, 8, 0, 3, 16, 5]

    def records(cost):
        return pd.DataFrame({"drafted": drafted, "step_s": [cost.seconds(1, 1 + d, int(d > 0)) for d in drafted]})

    rng = random.Random(0)  # random text over 12 tokens: many short matches, most of their drafts wrong
    prompts, produced = ([[rng.randrange(12) for _ in range(30)] for _ in range(8)] for _ in range(2))
    settings = SuffixSettings(min_prob=0.0, factor=2.0, offset=1.0)
    cheap, table = choose_min_score(prompts, produced, records(StepCost(0.060, 0.0, 0.0)), settings)
    assert cheap == 0.0 and table.loc[table["chosen"], "min_score"].tolist() == [0.0]
    dear, table = choose_min_score(prompts, produced, records(StepCost(0.060, 0.004, 0.060)), settings)
    assert dear > 0.0 and table.attrs["step_cost"].drafted_surcharge_s == pytest.approx(0.060)
    priced = table.set_index("min_score")["priced_tokens_per_s"]
    assert priced[dear] > priced[0.0]
