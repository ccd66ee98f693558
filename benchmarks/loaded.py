"""Loaded points through a worker: measured against the clients simulated from each point's one-client run.

Reads a tune folder that measured points at several client counts (`benchmarks/fidelity.py --worker ...
--clients 1 2 4 8`): for each loaded point, its one-client run's steps are dealt to the clients and
played against the worker's batching rule (`plan/queueing.py`), the forwards priced by the target's
profile brought to the one-client run's speed (its in-loop forwards over the profile's), the worker's
wait cap the fixed cost of a forward fitted on those runs (the worker's default, `--batch-wait-ms
auto`). Two ways: each step's own drafting time (`own`), and every step the run's mean drafting time
(`mean`: what a tune knows before it runs a point, from the draft's profile). Optionally the prediction the
tune made (`--fidelity-json`: lock-step in fidelity runs before 2026-11-27 02:00 UTC, simulated since). Prints
a table and writes JSON.

    python benchmarks/loaded.py --folder results/fidelity-qwen/qwen2.5-coder-1.5b-humaneval \
        --fidelity-json results/fidelity-qwen.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import pandas as pd

import common
from specbench.plan.predict import HostCost
from specbench.plan.queueing import WorkerRules
from specbench.plan.library import load_profiles
from specbench.tune.loaded import from_records, run_clients


def runs(folder: Path) -> dict:
    """{(method, k, clients): records} of the folder's measured points."""
    out = {}
    for path in sorted((folder / "measured").glob("*.json")):
        if path.name.endswith(".proposals.json"):
            continue
        records = pd.DataFrame(json.loads(path.read_text()))
        clients = records["client"].nunique() if "client" in records else 1
        out[(records["method"].iloc[0], int(records["k"].iloc[0]), int(clients))] = records
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", required=True, help="a tune folder (measured/ and profiles/)")
    parser.add_argument("--target", default=None, help="the target's name in the profiles (default: the largest)")
    parser.add_argument("--fidelity-json", default=None, help="fidelity.py's JSON, for the tune's own predictions")
    parser.add_argument("--out", default=str(common.RESULTS / "loaded.json"))
    args = parser.parse_args()
    folder = Path(args.folder)
    profiles = load_profiles(folder / "profiles")
    profile = next(p for p in profiles if args.target in (None, p.model) and len(p.batches) > 1)
    measured = runs(folder)
    alone = {key: records for key, records in measured.items() if key[2] == 1}
    context = profile.rows[0][1]
    # the worker's wait cap by default: a forward's fixed cost, fitted over the one-client runs' forwards
    widths = np.concatenate([1 + r["drafted"].to_numpy() for r in alone.values()])
    seconds = np.concatenate([r["target_forward_s"].to_numpy() for r in alone.values()])
    slope, fixed = np.polyfit(widths, seconds, 1)
    tuned = {}
    if args.fidelity_json:
        for point in json.loads(Path(args.fidelity_json).read_text())["points"]:
            tuned[(point["method"], int(point["k"]), int(point["clients"]))] = point["calibrated_tokens_per_s"]
    rows = []
    for (method, k, clients), records in sorted(measured.items()):
        lone = alone.get((method, k, 1))
        if clients == 1 or lone is None:
            continue
        profiled = [profile.forward_s(1 + d, context) for d in lone["drafted"]]
        speed = statistics.median(lone["target_forward_s"] / profiled)
        host = float((lone["verify_s"] - lone["target_forward_s"]).median())
        rules = WorkerRules(lambda w, c, n: speed * profile.forward_s(w, c, n), HostCost(host),
                            wait_cap_s=max(fixed, 0))
        own = run_clients(from_records(lone), clients, rules)
        mean = run_clients(from_records(lone.assign(draft_s=lone["draft_s"].mean())), clients, rules)
        value = float(records["emitted"].sum() / records["step_s"].sum())
        row = {"method": method, "k": k, "clients": clients, "measured_tokens_per_s": value,
               "simulated_own": own.tokens_per_s, "simulated_mean": mean.tokens_per_s,
               "error_own": own.tokens_per_s / value - 1, "error_mean": mean.tokens_per_s / value - 1,
               "rows_measured": float(records["batch_size"].mean()), "rows_simulated": own.mean_rows,
               "queue_ms_measured": 1000 * float(records["queue_s"].median()),
               "queue_ms_simulated": 1000 * statistics.median(own.queue_s)}
        if (method, k, clients) in tuned:
            row["tuned"] = tuned[(method, k, clients)]
            row["error_tuned"] = row["tuned"] / value - 1
        rows.append(row)
    table = pd.DataFrame(rows)
    errors = [c for c in table if c.startswith("error_")]
    summary = table.groupby("clients")[errors].agg(lambda e: e.abs().median())
    summary.loc["all (median)"] = table[errors].abs().median()
    summary.loc["all (p90)"] = table[errors].abs().quantile(0.9)
    print(table.round(3).to_string(index=False))
    print(f"\nwait cap (fitted forward fixed cost) {1000 * fixed:.0f} ms; median |error| by clients:")
    print(summary.round(3).to_string())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": common.machine(), "folder": str(folder),
                                          "wait_cap_s": float(fixed), "points": rows,
                                          "summary": summary.reset_index().to_dict("records")}, indent=1))


if __name__ == "__main__":
    main()
