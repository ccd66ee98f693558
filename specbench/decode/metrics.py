"""Metrics derived from raw step records by pure functions, named as in DESIGN.md §3.

acceptance_rate = accepted draft tokens / drafted tokens; tokens_per_step = 1 + mean accepted
drafts (the bonus token included, as vLLM and Spec-Bench count); tokens/s counts emitted tokens
over decode time (prefill excluded, identical for every method on the same prompt).
"""
from __future__ import annotations

import pandas as pd


def acceptance_rate(records: pd.DataFrame) -> float:
    drafted = records["drafted"].sum()
    return float(records["accepted"].sum() / drafted) if drafted else float("nan")


def tokens_per_step(records: pd.DataFrame) -> float:
    return float(1.0 + records["accepted"].mean()) if len(records) else float("nan")


def tokens_per_second(records: pd.DataFrame) -> float:
    seconds = records["step_s"].sum()
    return float(records["emitted"].sum() / seconds) if seconds else float("nan")


def per_position_acceptance(records: pd.DataFrame) -> pd.Series:
    """P(draft position j accepted | position j was drafted), j = 1..max drafted.

    Example: steps with (drafted, accepted) = (3, 1) and (3, 3) give j=1: 1.0, j=2: 0.5, j=3: 0.5.
    """
    longest = int(records["drafted"].max()) if len(records) else 0
    rates = {}
    for position in range(1, longest + 1):
        drafted_here = records[records["drafted"] >= position]
        rates[position] = float((drafted_here["accepted"] >= position).mean())
    return pd.Series(rates, name="acceptance", dtype=float).rename_axis("position")


def reply_position(records: pd.DataFrame, keys: tuple[str, ...] = ("method", "client", "prompt_index")) -> pd.Series:
    """Tokens of its reply emitted before each step (the steps of a reply in order): where in a reply a
    step drafted, since acceptance changes along one (a long reply repeats itself more)."""
    keys = [key for key in keys if key in records]
    ordered = records.sort_values("step", kind="stable") if "step" in records else records
    return (ordered.groupby(keys, sort=False)["emitted"].cumsum() - ordered["emitted"]).reindex(records.index)


def tokens_per_step_by_position(records: pd.DataFrame, width: int = 32) -> pd.DataFrame:
    """Tokens per step of each method's steps that began in each `width` tokens of their reply (columns
    "0-31", "32-63", ...; rows the methods): a figure from short replies says little of long ones."""
    start = (reply_position(records) // width * width).astype(int)
    table = (records.assign(start=start).groupby(["method", "start"], sort=False)["accepted"].mean() + 1.0).unstack()
    table = table[sorted(table.columns)]
    table.columns = [f"{s}-{s + width - 1}" for s in table.columns]
    return table


def time_split(records: pd.DataFrame) -> dict[str, float]:
    """Mean seconds per step spent drafting, on the network, verifying, and in orchestration."""
    return {"draft_s": float(records["draft_s"].mean()), "network_s": float(records["network_s"].mean()),
            "verify_s": float(records["verify_s"].mean()), "overhead_s": float(records["overhead_s"].mean())}


def summarize(records: pd.DataFrame, by: str | list[str] = "method") -> pd.DataFrame:
    """One row per group with every headline metric; the ratio to target-only when it was run."""
    rows = []
    for key, group in records.groupby(by, sort=False):
        split = time_split(group)
        rows.append({
            **(dict(zip(by, key)) if isinstance(by, list) else {by: key}),
            "tokens": int(group["emitted"].sum()), "steps": len(group),
            "tokens_per_s": tokens_per_second(group), "acceptance_rate": acceptance_rate(group),
            "tokens_per_step": tokens_per_step(group),
            **{f"{name[:-2]}_ms_per_step": 1000 * value for name, value in split.items()},
        })
    table = pd.DataFrame(rows)
    if by == "method" and "target-only" in set(table["method"]):
        base = table.loc[table["method"] == "target-only", "tokens_per_s"].iloc[0]
        table["speedup_vs_target_only"] = table["tokens_per_s"] / base
    return table
