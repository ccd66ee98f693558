"""A measured point of a tune as a row of its table: the run's speed and cost beside what was predicted for it,
before calibration, at the calibration window and just before it ran, and why it missed where it did."""
from __future__ import annotations

from typing import Optional

import pandas as pd

from specbench.plan.explore import cost_column, measured_points
from specbench.tune.spec import GOAL_ERROR, TuneSpec


def measured_row(candidate: str, method: str, k: int, records: pd.DataFrame, predicted: pd.DataFrame, raw: pd.DataFrame,
         spec: TuneSpec, rtt_ms: float, label: Optional[str] = None, at_run: Optional[pd.DataFrame] = None,
         clients: int = 1) -> dict:
    """A measured point against its predictions: before calibration (`raw`), at the calibration window
    (`predicted`) and as priced just before it ran (`at_run`: in mode "runs" with what the points measured
    before it taught, in "per-point" with its widths re-timed); the error after calibration is taken from
    `at_run` where given, else from the window's."""
    where = "remote" if spec.endpoint else "local"
    priced = measured_points(records.assign(method=method, k=k), where=where, rtt_ms=rtt_ms, clients=clients).iloc[0]
    label = label or predicted.loc[predicted["kind"] == "none", "label"].iloc[0]
    at = predicted["label"] == label
    cost = cost_column(spec.objective)

    def value(frame: pd.DataFrame, column: str = "tokens_per_s") -> float:
        return float(frame.loc[(frame["label"] == label).values, column].iloc[0])

    window, before = value(predicted), value(raw)
    calibrated = value(at_run) if at_run is not None else window
    calibrated_cost = value(at_run if at_run is not None else predicted, cost)
    measured = float(priced["tokens_per_s"])
    row = {"label": label, "candidate": candidate, "method": method, "k": k, "clients": clients,
           "measured_tokens_per_s": measured,
           "predicted_tokens_per_s": before, "window_tokens_per_s": window, "calibrated_tokens_per_s": calibrated,
           "error_before": before / measured - 1, "error_window": window / measured - 1,
           "error_after": calibrated / measured - 1,
           "measured_tokens_per_step": float(priced["tokens_per_step"]),
           "predicted_tokens_per_step": float(predicted.loc[at, "tokens_per_step"].iloc[0]),
           cost: float(priced[cost]), "calibrated_cost": calibrated_cost,
           "cost_error_after": calibrated_cost / float(priced[cost]) - 1 if float(priced[cost]) else float("nan"),
           "steps": int(priced["steps"]),
           "measured_forward_ms": 1000 * float(records["target_forward_s"].mean()),
           "queue_ms": 1000 * float(records["queue_s"].mean())}
    if "replay_misses" in records and "client" in records:  # steps a replaying client drafted itself (near-ties)
        row["replay_misses"] = int(records.groupby("client")["replay_misses"].first().sum())
    row["flag"] = _reason(row) if abs(row["error_after"]) > GOAL_ERROR else ""
    return row


def _reason(row: dict) -> str:
    """Why a point missed, from its records: replayed drafts that parted from their lone run, acceptance, the
    forward's cost, queueing, or the loop."""
    if row.get("replay_misses", 0) > 0.1 * row["steps"]:
        return (f"replay: {row['replay_misses']} of {row['steps']} steps met a context the draft never drafted alone "
                f"(a batched near-tie parted the request), drafted on this box beside the worker")
    shift = row["measured_tokens_per_step"] / row["predicted_tokens_per_step"] - 1
    if abs(shift) > 0.05:
        return (f"acceptance shift: {row['predicted_tokens_per_step']:.2f} tokens per step on the calibration "
                f"prompts, {row['measured_tokens_per_step']:.2f} on the held-back ones")
    if row["queue_ms"] > 0.05 * 1000 / max(row["measured_tokens_per_s"], 1e-6):
        return f"queueing: {row['queue_ms']:.0f} ms per step waiting in the worker"
    return "forward cost: the step's forwards took other times than the calibrated profile says"
