"""The cost objectives, in one table: what the predictor prices, the explorer offers, the CLI accepts.

Why one table: the objectives were listed four times (the cost model, the explorer, the predictor's
columns, the CLI's choices) and disagreed. An objective is a name, the column its value lands in
(per 1M generated tokens), its unit and the pure function that prices one step (`plan/costs.py`).
Adding one is one `register(Objective(...))` call; `tests/custom_objective.py` does it end to end.

Example: `OBJECTIVES["draft_energy"].value(step, prices, power)` is the joules spent drafting per
1M tokens for `step`, and predictions carry it as `draft_energy_j_per_mtok`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from specbench.plan.costs import (Power, Prices, StepCost, api_cost_per_mtok, draft_energy_j_per_mtok,
                                  target_energy_j_per_mtok, total_cost_per_mtok)
from specbench.registry import Registry


@dataclass(frozen=True)
class Objective:
    name: str
    column: str  # where predictions and measurements keep its value
    unit: str  # "$", "J" or "s"
    value: Callable[[StepCost, Prices, Power], float]  # lower is better
    description: str
    # when target-only costs nothing here (it drafts nothing), the column the cost knob scales by instead
    free_scale: Optional[str] = None


OBJECTIVES: Registry[Objective] = Registry("objective")
register, get_objective = OBJECTIVES.register, OBJECTIVES.lookup


def by_column(column: str) -> Optional[Objective]:
    return next((o for o in OBJECTIVES.values() if o.column == column), None)


def cost_columns(step: StepCost, prices: Prices, power: Power) -> dict[str, float]:
    """Every objective's value for one step, by column: what a predicted or measured row carries."""
    return {o.column: o.value(step, prices, power) for o in OBJECTIVES.values()}


for _objective in (
    Objective("api_cost", "api_cost_usd_per_mtok", "$", lambda step, prices, power: api_cost_per_mtok(step, prices),
              "target-side $: GPU $/hour x the seconds its device is held (verifies, shared by batched clients, and "
              "drafting that runs there: a local draft, a worker-side one), or an API price"),
    Objective("total_cost", "total_cost_usd_per_mtok", "$", total_cost_per_mtok,
              "api_cost + the client's drafting energy x $/kWh + bytes on the wire x $/GB (AutoDraft's total cost)"),
    Objective("draft_energy", "draft_energy_j_per_mtok", "J",
              lambda step, prices, power: draft_energy_j_per_mtok(step, power),
              "joules spent drafting, at the drafting device's watts: the user's battery where the client drafts",
              free_scale="target_energy_j_per_mtok"),
    Objective("target_energy", "target_energy_j_per_mtok", "J",
              lambda step, prices, power: target_energy_j_per_mtok(step, power),
              "joules of the target's verifies (shared by batched clients)"),
    Objective("energy_total", "energy_total_j_per_mtok", "J",
              lambda step, prices, power: draft_energy_j_per_mtok(step, power) + target_energy_j_per_mtok(step, power),
              "draft and target joules together"),
    Objective("latency", "latency_s_per_token", "s", lambda step, prices, power: 1.0 / step.tokens_per_s,
              "seconds per generated token (the cost knob then weighs speed against itself)"),
):
    register(_objective)


def objective_value(name: str, step: StepCost, prices: Prices, power: Power) -> float:
    """One objective's value for one step (lower is better)."""
    return get_objective(name).value(step, prices, power)
