"""How much a tune measures beyond its list, and what: the best measured point's neighbouring K while its
measuring stays within a share of what an exhaustive sweep of its points would take.

Why: the choice is made among measured points, and a neighbour the prediction ranked a little lower is often
as good (run G of 2026-11-27: the sweep's best, the 0.5B at K=6, was never measured while the tune had spent
15.9% of the sweep's measuring time against an allowed 20%).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import pandas as pd

from specbench.plan.explore import cost_column
from specbench.tune.spec import TuneSpec


def sweep_points(predicted: pd.DataFrame, spec: TuneSpec) -> pd.DataFrame:
    """What an exhaustive sweep of a tune's points measures: every point at one client; through a worker, every load."""
    return predicted[(predicted["clients"] == 1) | bool(spec.endpoint)]


def as_points(measured: pd.DataFrame) -> list[dict]:
    """Measured rows as points `plan.predict.choose` ranks: their measured speed, target-only the reference."""
    return [dict(r, kind="none" if r["method"] == "target-only" else "chain", tokens_per_s=r["measured_tokens_per_s"])
            for r in measured.to_dict("records")]


def one_client_run(every: list[dict], row: dict) -> Optional[dict]:
    """The one-client point of `row`'s draft and K, which a model draft's loaded point replays; None if not predicted."""
    twin = (row["candidate"], row["kind"], int(row["k"]))
    return next((r for r in every if (r["candidate"], r["kind"], int(r["k"])) == twin and int(r["clients"]) == 1), None)


def estimate_s(row: dict, held: int, spec: TuneSpec) -> float:
    """Seconds a point's run takes as predicted: its clients share the held-back prompts."""
    return -(-held // int(row["clients"])) * spec.max_new_tokens / max(row["tokens_per_s"], 1e-3)


def measuring_s(records: pd.DataFrame, clients: int = 1) -> float:
    """The seconds a run's steps and prefills took; its clients' steps overlap, so their sum over the clients."""
    return float(records["step_s"].sum() + records["prefill_s"].drop_duplicates().sum()) / clients


@dataclass
class MeasuringShare:
    """How much measuring the tune may still do: `share` of an exhaustive sweep's measuring time, that time
    estimated from the predictions (`estimated_s`) and scaled by how long the measured points took against
    their own estimates (the predictions leave out prefills and the loop's own time)."""

    share: float
    estimated_s: float
    estimates_s: float = 0.0
    taken_s: float = 0.0

    def took(self, estimate_s: float, taken_s: float) -> None:
        self.estimates_s += estimate_s
        self.taken_s += taken_s

    def ratio(self) -> float:
        return self.taken_s / self.estimates_s if self.estimates_s > 0 else 1.0

    def sweep_s(self) -> float:
        return self.ratio() * self.estimated_s

    def allows(self, spent_s: float, estimate_s: float) -> bool:
        """Whether a point estimated at `estimate_s` fits, after `spent_s` seconds of measuring."""
        return spent_s + self.ratio() * estimate_s <= self.share * self.sweep_s()


def neighbour(predicted: pd.DataFrame, measured: pd.DataFrame, spec: TuneSpec, free: Iterable[str]) -> Optional[dict]:
    """The next point to measure around the best measured one (by J at `cs`): its draft at the neighbouring K
    of `spec.chain_ks` under the same load, the better predicted first; for a model draft's loaded point, its
    one-client run first (the loaded run replays its proposals). None when every neighbour is measured."""
    from specbench.plan.predict import knob_values

    column = cost_column(spec.objective)
    done = set(measured["label"])
    rows = as_points(measured)
    values = knob_values(rows, spec.cs, cost=column)
    every = predicted.to_dict("records")
    base = [r for r in every if r["kind"] == "none"]
    for best in (measured.iloc[i] for i in sorted(range(len(rows)), key=values.__getitem__)):
        if best["method"] == "target-only":
            continue  # no K to look around
        point = next(r for r in every if r["label"] == best["label"])
        ks = sorted({int(r["k"]) for r in every if (r["candidate"], r["kind"]) == (point["candidate"], point["kind"])})
        at = ks.index(int(point["k"]))
        near = [ks[i] for i in (at - 1, at + 1) if 0 <= i < len(ks)]
        around = [r for r in every if r["candidate"] == point["candidate"] and r["kind"] == point["kind"]
                  and int(r["clients"]) == int(point["clients"]) and int(r["k"]) in near and r["label"] not in done]
        if not around:
            continue  # the best's neighbours are measured: look around the next best
        scores = knob_values(base + around, spec.cs, cost=column)[len(base):]
        row = around[scores.index(min(scores))]
        if int(row["clients"]) > 1 and row["candidate"] not in free:
            first = one_client_run(every, row)
            if first is not None and first["label"] not in done:
                return first
        return row
    return None
