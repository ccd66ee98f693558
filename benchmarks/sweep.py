"""The same 16-cell SmolLM2 sweep run locally and on a local Ray cluster of 2 workers, then on Ray with a
worker killed mid-sweep: wall time, Ray's overhead per cell, and cells lost (goals: < 10% of a cell's
run time; 0 lost).

Ray's overhead is what the workers spent not running cells: 2 x wall time - the cells' own seconds,
per cell (worker start-up, imports, scheduling, result transfer and the idle tail all count). Ray's
start-up (`ray.init`) is reported on its own. Usage: python benchmarks/sweep.py [--tokens 32]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from common import RESULTS, write_report

from specbench.sweep import expand, sweep
from specbench.sweep.drill import kill_running_cell_later

COMPARED = ["cell", "method", "prompt_index", "step", "emitted_tokens"]


def grid(tokens: int):
    """16 cells: 4 budgets x 4 single-prompt slices of the bench set, target-only and prompt lookup side by side."""
    return expand({"k": [2, 3, 4, 6], "prompt_start": [0, 1, 2, 3]},
                  {"target": "smollm2-135m", "methods": ["target-only", "prompt-lookup"], "prompt_count": 1,
                   "max_new_tokens": tokens})


def comparable(records):
    frame = records[COMPARED].sort_values(COMPARED[:4]).reset_index(drop=True)
    return frame.assign(emitted_tokens=frame["emitted_tokens"].map(list))


def measured(name, report, workers, extra=None):
    cell_seconds = float(report.status["seconds"].sum())
    idle = workers * report.wall_s - cell_seconds
    mean_cell = cell_seconds / len(report.status)
    return {"executor": name, "workers": workers, "cells": len(report.status), "ran": report.ran,
            "failed": report.failed, "wall_s": report.wall_s, "cell_s_mean": mean_cell,
            "overhead_s_per_cell": idle / len(report.status), "overhead_vs_cell": idle / len(report.status) / mean_cell,
            "models_loaded": int(report.status["models_loaded"].sum()), **(extra or {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "sweep.json"))
    args = parser.parse_args()
    import ray

    cells = grid(args.tokens)
    scratch = Path(tempfile.mkdtemp(prefix="sweep_bench_"))
    rows = []
    local = sweep(cells, scratch / "local", executor="local")
    rows.append(measured("local (1 process, 2 threads)", local, workers=1))

    started = time.time()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    init_s = time.time() - started
    on_ray = sweep(cells, scratch / "ray", executor="ray", cpus_per_cell=1)
    rows.append(measured("ray (2 workers x 1 thread)", on_ray, workers=2, extra={"ray_init_s": init_s}))
    identical = comparable(on_ray.records).equals(comparable(local.records))

    killed = kill_running_cell_later(scratch / "ray-kill", after_landed=4)
    drill = sweep(cells, scratch / "ray-kill", executor="ray", cpus_per_cell=1)
    landed = set(drill.records["cell"])
    duplicates = int((drill.records.groupby(COMPARED[:4]).size() > 1).sum())
    rows.append(measured("ray, a worker killed mid-sweep", drill, workers=2,
                         extra={"killed_pid": killed.get("pid"), "cells_lost": len(cells) - len(landed),
                                "duplicate_rows": duplicates}))
    rerun_started = time.time()
    rerun = sweep(cells, scratch / "ray-kill", executor="ray", cpus_per_cell=1, progress=False)
    ray.shutdown()
    shutil.rmtree(scratch, ignore_errors=True)

    print(f"\n16-cell SmolLM2 grid, {args.tokens} new tokens per prompt; Ray init {init_s:.1f} s (not in wall)")
    print(f"{'executor':34s} {'wall s':>7s} {'cell s':>7s} {'overhead/cell':>14s} {'loads':>6s} {'lost':>5s}")
    for row in rows:
        print(f"{row['executor']:34s} {row['wall_s']:7.1f} {row['cell_s_mean']:7.2f} "
              f"{row['overhead_s_per_cell']:6.2f} s {row['overhead_vs_cell']:5.1%} {row['models_loaded']:6d} "
              f"{row.get('cells_lost', '')!s:>5s}")
    print(f"Ray records identical to local (greedy fp32 tokens): {identical}; killed worker pid "
          f"{killed.get('pid')}; rerun of the finished sweep ran {rerun.ran} cells in "
          f"{time.time() - rerun_started:.1f} s")
    write_report(args.out, {"tokens": args.tokens, "rows": rows, "identical": identical, "rerun_ran": rerun.ran,
                            "goals": {"ray_overhead_vs_cell_below": 0.10, "cells_lost": 0}})


if __name__ == "__main__":
    main()
