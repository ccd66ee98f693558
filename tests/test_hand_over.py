"""A hybrid's hand-over chosen from a calibration run: the replay takes a real run's steps, one for one."""
import math

import pandas as pd
import pytest

from specbench.api import outputs, run
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.route.hand_over import choose_catch_up, choose_hand_over, draft_prices, replay_hand_overs
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
    steps = {}
    for hand_over, trust, bench_below in ((0.5, 2.0, 0.0), (0.5, math.inf, 0.0), (2.0, 2.0, 0.0), (2.0, 2.0, 1.5)):
        # the request's records: suffix decoding's scales its scores, the draft's benches it below bench_below
        settings = SuffixSettings(cache="drafter", hand_over=hand_over, other_k=3, trust=trust, bench_below=bench_below)
        records = run(tiny_target, REPEATING, method=method, draft=tiny_draft, k=8, max_new_tokens=24, progress=False,
                      warmup=False, suffix=settings)
        table = replay_hand_overs(REPEATING, answers, tiny_draft, settings, cost, 0.01, k=8, tree=tree,
                                  hand_overs=[hand_over])
        row = table.iloc[0]
        assert row["steps"] == len(records) and row["tokens"] == records["emitted"].sum()
        assert row["verified"] == len(records) + records["drafted"].sum()
        steps[hand_over, trust, bench_below] = len(records)
    assert steps[0.5, 2.0, 0.0] != steps[0.5, math.inf, 0.0]  # the record changed the run, and the replay followed it
    assert steps[2.0, 2.0, 1.5] != steps[2.0, 2.0, 0.0]  # so did benching the draft
    for catch_up in (0.5, 2.0):  # the draft's reads replayed too: which steps it skips for them, and its cache
        settings = SuffixSettings(cache="drafter", hand_over=1.0, other_k=3, catch_up=catch_up)
        records = run(tiny_target, REPEATING, method=method, draft=tiny_draft, k=8, max_new_tokens=24, progress=False,
                      warmup=False, suffix=settings)
        table = replay_hand_overs(REPEATING, answers, tiny_draft, settings, cost, 0.01, k=8, tree=tree,
                                  catch_ups=[catch_up], max_new_tokens=24)
        row = table.iloc[0]
        assert row["steps"] == len(records) and row["tokens"] == records["emitted"].sum()
        assert row["verified"] == len(records) + records["drafted"].sum() and row["catch_up"] == catch_up
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


def test_the_draft_is_priced_a_step_and_a_token_read_and_a_dear_read_keeps_it_off_long_prompts(tiny_target,
                                                                                                tiny_draft):
    """`draft_prices`: the chain's median drafting seconds a step, and its first step's excess over the prompt's
    length (the step that read the prompt). A catch-up that changes nothing is never chosen over a lower one that
    prices the same (the lowest of equals); where reads cost a great deal, the lowest catch-up, the model
    drafting fewer steps."""
    lengths = [10, 40, 100]
    chain = pd.DataFrame([{"method": "chain", "prompt_index": p, "step": s, "drafted": 3, "emitted": 2,
                           "step_s": 1.0, "draft_s": 0.4 + (0.005 * lengths[p] if s == 0 else 0.0)}
                          for p in range(3) for s in range(5)])
    step_s, read_s = draft_prices(chain, lengths)
    assert step_s == pytest.approx(0.4) and read_s == pytest.approx(0.005)
    base = run(tiny_target, REPEATING, method=["target-only", "suffix"], max_new_tokens=24, k=8, progress=False,
               warmup=False, suffix=SuffixSettings(cache="drafter"))
    answers = [outputs(base)[("target-only", i)] for i in range(len(REPEATING))]
    lengths = [len(p) for p in REPEATING]
    chosen = {}
    for read in (0.0, 1000.0):
        chain = pd.DataFrame([{"method": "chain", "prompt_index": p, "step": s, "drafted": 3, "emitted": 2,
                               "step_s": 0.05, "draft_s": 0.01 + (read * lengths[p] if s == 0 else 0.0)}
                              for p in range(len(REPEATING)) for s in range(3)])
        chosen[read], table = choose_catch_up(REPEATING, answers, pd.concat([base, chain]), tiny_draft,
                                              SuffixSettings(other_k=3, hand_over=2.0), k=8,
                                              catch_ups=(0.25, 1.0, math.inf), max_new_tokens=24)
        assert table["chosen"].sum() == 1
        rows = table.set_index("catch_up")  # these prompts are short: at 1.0 the model reads what it reads at inf
        assert rows.loc[0.25, "model_steps"] < rows.loc[1.0, "model_steps"] == rows.loc[math.inf, "model_steps"]
        assert rows.loc[1.0, "priced_tokens_per_s"] == rows.loc[math.inf, "priced_tokens_per_s"]
        assert table["read"].is_monotonic_increasing
    assert chosen[0.0] < math.inf and chosen[1000.0] == 0.25  # the lowest of equals; a dear read: the lowest
