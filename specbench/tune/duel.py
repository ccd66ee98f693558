"""The best measured point and a close runner-up run side by side before a tune chooses between them.

Why: a tune measures its points one after another, minutes apart, and a VM's speed moves 15-20% in that time,
more than two close candidates differ (benchmarks/results/2026-12-03-tune-at-a-temperature.md: at temperature 0.8
a tune chose prompt lookup, measured at 4.91 tok/s two minutes after the chain's 3.99; interleaved, the chain ran
1.28x target-only and prompt lookup 1.14-1.24x). In one `run` call every held-back prompt goes through
target-only and both points in turn, so the drift weighs on the three alike, and the choice is made on that run.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import pandas as pd

from specbench.plan.explore import cost_column, measured_points
from specbench.tune.share import as_points, estimate_s
from specbench.tune.spec import TuneSpec

CLOSE = 0.3  # the runner-up runs beside the best when its J is within this share of the best's (drift seen: 15-37%)


def contenders(table: pd.DataFrame, spec: TuneSpec, candidates, drafts: dict) -> Optional[list[dict]]:
    """The best measured one-client point by J at cs and the next best that one `run` can hold beside it, when
    within `CLOSE` of it: another method (a call runs each method once: the best's own neighbouring K is
    skipped), at most one draft model, no differing layer count or quantization. None otherwise."""
    from specbench.plan.predict import knob_values

    rows = as_points(table)
    values = knob_values(rows, spec.cs, cost=cost_column(spec.objective))
    ranked = [(values[i], rows[i]) for i in sorted(range(len(rows)), key=values.__getitem__)
              if rows[i]["method"] != "target-only" and int(rows[i]["clients"]) == 1]
    by_name = {c.name: c for c in candidates}
    for value, other in ranked[1:]:
        if value > ranked[0][0] * (1 + CLOSE):
            return None
        pair = [ranked[0][1], other]
        chosen = [by_name[row["candidate"]] for row in pair]
        models = {id(drafts[c.name]) for c in chosen if drafts.get(c.name) is not None}
        options = {(c.self_draft_layers, c.quantization) for c in chosen if c.method in ("self-draft", "substitute")}
        if pair[0]["method"] != pair[1]["method"] and len(models) <= 1 and len(options) <= 1:
            return pair
    return None


def side_by_side(store, runner, pair: list[dict], base_label: str, candidates, drafts: dict, held: list,
                 spec: TuneSpec, rtt_ms: float, progress, suffix: Optional[dict] = None) -> pd.DataFrame:
    """Target-only and the points of `pair` in one interleaved run over the held-back prompts (cached in the
    tune's folder): a row per point with its measured speed and cost, as the choice reads them. `suffix`: suffix
    decoding's settings changed for the run (a hybrid's, `tune/hybrid.py`)."""
    from specbench.tune.phases import point_key, run_options

    by_name = {c.name: c for c in candidates}
    chosen = [by_name[row["candidate"]] for row in pair]
    key = "duel-" + "-".join(point_key(spec, c, row["method"], int(row["k"]), held) for c, row in zip(chosen, pair))
    key += "".join(f"-{name}{value:g}" for name, value in sorted((suffix or {}).items()))
    records = store.measured(key)
    if records is None:
        from specbench.api import run

        # each point's options as `phases.measure` gives them; `contenders` let at most one draft, layer count or
        # quantization between them, so a later point's set options fill the earlier ones' unset ones
        options = {}
        for each in (run_options(c, drafts.get(c.name), spec, runner) for c in chosen):
            options.update({name: value for name, value in each.items() if value is not None or name not in options})
        if suffix:
            options["suffix"] = replace(options["suffix"], **suffix)
        records = run(runner, held, method=["target-only", *(f"{row['method']}:{int(row['k'])}" for row in pair)],
                      progress="tune: side by side" if progress else False, **options)
        records = records.drop(columns=[c for c in ("emitted_tokens", "tree_widths") if c in records])
        store.save_measured(key, records)
    where = "remote" if spec.endpoint else "local"
    column = cost_column(spec.objective)
    found = []
    for row in [None, *pair]:
        method = "target-only" if row is None else row["method"]
        own = records[records["method"] == method]
        priced = measured_points(own.assign(k=0 if row is None else int(row["k"])), where=where, rtt_ms=rtt_ms,
                                 clients=1).iloc[0]
        found.append({"label": base_label if row is None else row["label"],
                      "candidate": "target-only" if row is None else row["candidate"], "method": method,
                      "k": 0 if row is None else int(row["k"]), "clients": 1,
                      "measured_tokens_per_s": float(priced["tokens_per_s"]), column: float(priced[column]),
                      "tokens_per_step": float(priced["tokens_per_step"])})
    return pd.DataFrame(found)


def settle(table, spec, candidates, drafts, store, runner, held, rtt_ms, deadline, progress, left_out):
    """The `contenders` of `table` run side by side when the time budget allows: that run's rows (target-only
    first), or None (then the tune chooses from `table`)."""
    pair = contenders(table, spec, candidates, drafts)
    if pair is None:
        return None
    estimate = sum(estimate_s(row, len(held), spec) for row in as_points(pd.DataFrame([table.iloc[0].to_dict(), *pair])))
    if time.monotonic() + estimate > deadline:
        left_out.append(f"{pair[0]['label']} beside {pair[1]['label']}: not run side by side, ~{estimate:.0f} s would "
                        f"pass the budget; chosen from their runs apart")
        return None
    return side_by_side(store, runner, pair, table.iloc[0]["label"], candidates, drafts, held, spec, rtt_ms, progress)


def choice_rows(table: pd.DataFrame, duel: Optional[pd.DataFrame]) -> pd.DataFrame:
    """What a tune chooses from: the measured points, or, after a duel, its run and the points it did not settle (those
    at several clients and suffix decoding's hybrid, whose rows carry its draft's `other_k`). Why: a duel runs the best
    two one-client points side by side; the loaded points it never ran were dropped from the choice with them."""
    if duel is None:
        return table
    kept = table["clients"] > 1
    if "other_k" in table:
        kept |= table["other_k"].notna()
    return pd.concat([duel, table[kept]], ignore_index=True)
