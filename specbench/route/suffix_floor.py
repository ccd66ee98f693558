"""Suffix decoding's floor (`SuffixSettings.min_score`) chosen from a calibration run instead of by hand.

Why: where a verify of two tokens costs far more than one (SmolLM2 in float32 on an AVX2 CPU: 1.7x), a step
with a doubtful draft costs more than it returns. How doubtful is too doubtful depends on the step cost on
this machine and on how far suffix decoding's own forecast overstates acceptance on this workload, so no
formula from the profile alone picks it (c(2)/c(1) - 1 = 0.7 there; the best floor was 2). Under greedy
decoding both are read off one calibration run: the target's own outputs replay the drafter's proposals at
each floor exactly (`tune/replay.chain_steps`: no model runs), and the run's records fit the step cost,
with a surcharge on every step that drafts at all.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import pandas as pd
import torch

from specbench.decode.suffix_drafter import SuffixDrafter, SuffixSettings
from specbench.methods import get_method
from specbench.tune.replay import chain_steps, drafter_proposer
from specbench.types import SpecbenchError

FLOORS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one SD step: `fixed_s` + `per_verified_token_s` x tokens verified (the bonus token
    included) + `drafted_surcharge_s` when anything was drafted (a multi-row verify's slower kernels)."""

    fixed_s: float
    per_verified_token_s: float
    drafted_surcharge_s: float

    def seconds(self, steps: int, verified: int, drafting_steps: int) -> float:
        return steps * self.fixed_s + verified * self.per_verified_token_s + drafting_steps * self.drafted_surcharge_s


def fit_step_cost(records: pd.DataFrame) -> StepCost:
    """Least squares over a run's steps (`drafted`, `step_s`: target-only's and the lookup methods', so that
    undrafted and drafted steps both pin the fit). A model draft's steps are left out (where `method` says which):
    their `step_s` holds the draft's own forwards, which would pass for a surcharge on every drafted step (the
    0.5B draft of the 1.5B Qwen: 0.75 s of drafting a step came out as a 0.42 s surcharge, the verify's own
    being none). Neither a verified token nor drafting can make a step cheaper: where the free fit says so (a
    small, noisy calibration did: -1.6 ms a token, and chose a floor the larger run did not), that term is held
    at 0 and the others refitted."""
    steps = records.dropna(subset=["drafted", "step_s"])
    if "method" in steps:
        steps = steps[steps["method"].map(_drafts_by_lookup)]
    drafted = steps["drafted"].astype(float)
    if len(steps) < 3 or drafted.eq(0).all() or drafted.gt(0).all():
        raise SpecbenchError("fitting the step cost needs steps that drafted and steps that did not (run "
                             "target-only or a lookup method among the calibration candidates)")
    design = torch.tensor([[1.0, 1.0 + d, float(d > 0)] for d in drafted], dtype=torch.float64)
    seconds = torch.tensor(steps["step_s"].to_numpy(dtype=float), dtype=torch.float64)[:, None]
    fixed, per_token, surcharge = torch.linalg.lstsq(design, seconds).solution[:, 0].tolist()
    if per_token < 0:
        fixed, surcharge = torch.linalg.lstsq(design[:, [0, 2]], seconds).solution[:, 0].tolist()
        per_token = 0.0
    if surcharge < 0:
        fixed, per_token = torch.linalg.lstsq(design[:, [0, 1]], seconds).solution[:, 0].tolist()
        surcharge = 0.0
        if per_token < 0:
            fixed, per_token = float(seconds.mean()), 0.0
    return StepCost(fixed, per_token, surcharge)


def _drafts_by_lookup(method: str) -> bool:
    """Target-only or a method whose drafting is a lookup (its steps' seconds are the target's own)."""
    try:
        found = get_method(method)
    except SpecbenchError:
        return False
    return found.kind == "none" or found.lookup


def replay_floors(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], settings: SuffixSettings,
                  cost: StepCost, k: int = 16, floors: Sequence[float] = FLOORS) -> pd.DataFrame:
    """One row per floor: the greedy chain run's steps, tokens verified and drafting steps on `prompts`
    (token ids) with the target's own `outputs`, replayed in order through one drafter whose cache takes
    each output as a run's does (its own cache: nothing else's is read or fed), and its tok/s priced by
    `cost`."""
    if len(prompts) != len(outputs) or not prompts:
        raise SpecbenchError(f"need one output per prompt, got {len(prompts)} prompts and {len(outputs)} outputs")
    rows = []
    for floor in floors:
        drafter = SuffixDrafter(replace(settings, min_score=float(floor), cache="drafter"))
        steps = []
        for prompt, output in zip(prompts, outputs):
            full = list(prompt) + list(output)
            steps += chain_steps(full, len(prompt), drafter_proposer(full, drafter), k)
            drafter.finish(full)
        tokens = sum(accepted + 1 for _, _, accepted in steps)
        verified = sum(drafted + 1 for _, drafted, _ in steps)
        drafting = sum(drafted > 0 for _, drafted, _ in steps)
        rows.append({"min_score": float(floor), "steps": len(steps), "tokens": tokens, "verified": verified,
                     "drafting_steps": drafting, "tokens_per_step": tokens / len(steps),
                     "priced_tokens_per_s": tokens / cost.seconds(len(steps), verified, drafting)})
    return pd.DataFrame(rows)


def choose_min_score(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], records: pd.DataFrame,
                     settings: SuffixSettings = SuffixSettings(), k: int = 16,
                     floors: Sequence[float] = FLOORS) -> tuple[float, pd.DataFrame]:
    """The floor whose replay is priced fastest (the lowest of equals) and the table it was chosen from
    (`chosen` marks it; `attrs["step_cost"]` holds the fit). `records`: the calibration run's step records."""
    cost = fit_step_cost(records)
    table = replay_floors(prompts, outputs, settings, cost, k, floors)
    return choose_fastest(table, "min_score", cost), table


def choose_fastest(table: pd.DataFrame, column: str, cost: StepCost) -> float:
    """The value of `column` whose replay is priced fastest, the lowest of equals (a replay's ties are exact),
    marked in `table["chosen"]`, with the fit kept in `table.attrs["step_cost"]`; shared by every replayed knob."""
    best = table["priced_tokens_per_s"].max()
    value = float(table.loc[table["priced_tokens_per_s"] >= best * (1 - 1e-9), column].min())
    table["chosen"] = table[column] == value
    table.attrs["step_cost"] = cost
    return value
