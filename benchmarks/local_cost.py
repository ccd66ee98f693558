"""What billing a local draft's seconds to the target's device changes: every shipped Pareto view, priced both ways.

Until 2026-12-07 the target's $ counted its verify seconds alone wherever the draft ran, so a local chain cost what
the same chain cost against a remote worker (the client's drafting priced as its energy) and a remote point could
never be the cheaper. Now drafting on the target's device (a local placement, a worker-side method) is billed as
that device's time and drawn at its power (`plan/costs.py`). This prices each view of the shipped profiles and
references (local and remote at each RTT, one client) under both rules, side by side in one process, and reports
per view and objective the recommendation at each cost weight, and whether any remote point is cheaper than the
local point of the same method and K. No model runs.

    python benchmarks/local_cost.py [--cs 0 0.5 1] [--rtts 10 50 100] [--out results/local_cost.json]
    python benchmarks/local_cost.py --tune smollm2-135m --tune-dir /tmp/tune-local   # + a tune, both ways

`--tune TARGET` also runs notebook 06's default tune (every draft that fits, `bench`, 6 prompts, K 1/2/4, 24 tokens,
total_cost at cs 0.5, here) under the new rule, then again in the same folder under the old one: its measured runs
are read back, not rerun, so the two choices are made on the same measurements (a point only the old rule's
side-by-side run would measure is run then).
"""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from unittest import mock

import pandas as pd

from specbench.plan.explore import matching_pairs, operating_points, recommend, target_groups, variants_frame
from specbench.plan.library import load_library
from specbench.plan.objectives import OBJECTIVES
from specbench.plan.predict import OperatingPoint

def verify_only():
    """The earlier rule: the target billed for its verifies alone, drafting always on the client."""
    return mock.patch.object(OperatingPoint, "drafts_on_target", property(lambda self: False))


def priced(combos, rtts) -> pd.DataFrame:
    points = partial(operating_points, rtts_ms=rtts, remote=True, local=True)
    return variants_frame(combos, points)


def view_rows(title: str, combos, rtts, cs_values, objectives) -> list[dict]:
    with verify_only():
        before = priced(combos, rtts)
    frames = {"verify only": before, "held device": priced(combos, rtts)}
    rows = []
    for objective in objectives:
        column = OBJECTIVES[objective].column
        for rule, frame in frames.items():
            local = frame[frame["where"] == "local"].set_index(["variant", "method", "k"])[column]
            remote = frame[frame["where"] == "remote"]
            cheaper = [r for r in remote.itertuples() if r.kind != "none"
                       and getattr(r, column) < local.get((r.variant, r.method, r.k), float("inf"))]
            row = {"view": title, "objective": objective, "rule": rule,
                   "remote points cheaper than their local twin": f"{len(cheaper)} of {int((remote.kind != 'none').sum())}"}
            for cs in cs_values:
                row[f"cs={cs:g}"] = recommend(frame, cs, objective)["label"]
            rows.append(row)
    return rows


def tune_both_ways(target: str, folder: str) -> pd.DataFrame:
    from specbench.tune import TuneSpec, tune

    spec = TuneSpec(target=target, drafts=("auto",), prompts="bench", prompt_count=6, chain_ks=(1, 2, 4),
                    max_new_tokens=24, budget_minutes=8, objective="total_cost", cs=0.5)
    rows = []
    for rule in ("held device", "verify only"):
        with verify_only() if rule == "verify only" else nullcontext():
            result = tune(spec, folder, progress=False)
        duel = result.side_by_side
        rows.append({"rule": rule, "chosen": result.chosen["label"],
                     "measured tok/s": result.chosen["measured_tokens_per_s"],
                     "side by side": None if duel is None else ", ".join(
                         f"{r.label} {r.measured_tokens_per_s:.2f}" for r in duel.itertuples())})
    return pd.DataFrame(rows)


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cs", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--rtts", type=float, nargs="+", default=[10.0, 50.0, 100.0])
    parser.add_argument("--objectives", nargs="+", default=["total_cost", "draft_energy"])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "local_cost.json"))
    parser.add_argument("--tune", help="also tune this target both ways (notebook 06's defaults)")
    parser.add_argument("--tune-dir", default=str(Path(__file__).resolve().parents[1] / "results" / "local-cost-tune"), help="the tune's folder (its runs are kept there)")
    args = parser.parse_args(argv)
    profiles, references = load_library(own=False)
    groups = target_groups(matching_pairs(profiles, references, free_drafts=True))
    rows = []
    for title, combos in groups.items():
        if not any(draft is not None for _, draft, _ in combos):
            continue  # prompt lookup alone drafts nothing: both rules price it alike
        rows += view_rows(title, combos, args.rtts, args.cs, args.objectives)
    table = pd.DataFrame(rows)
    changed = table.groupby(["view", "objective"]).apply(
        lambda g: any(g[c].nunique() > 1 for c in g.columns if c.startswith("cs=")), include_groups=False)
    with pd.option_context("display.max_colwidth", 70, "display.width", 250, "display.max_rows", 500):
        print(table.to_string(index=False))
    print(f"\n{int(changed.sum())} of {len(changed)} (view, objective) pairs recommend otherwise under the new rule")
    tuned = None
    if args.tune:
        tuned = tune_both_ways(args.tune, args.tune_dir)
        with pd.option_context("display.max_colwidth", 200, "display.width", 250):
            print(f"\ntune {args.tune}, both ways on the same measurements:\n{tuned.to_string(index=False)}")
    with open(args.out, "w") as handle:
        json.dump({"rows": rows, "changed": int(changed.sum()), "pairs": len(changed),
                   "tune": None if tuned is None else tuned.to_dict("records")}, handle, indent=1)
    return table


if __name__ == "__main__":
    main()
