"""How far the predictor is from measurement, and whether `specbench tune` finds what an exhaustive sweep finds.

Why: a recommendation is only as good as the prediction behind it, and a tune measures only a few
points. Per dataset, a tune (`specbench.tune`) runs as a user would; then every predicted point of one
client is measured on the same held-back prompts (the exhaustive sweep, which a user would not run).
Printed: per family of setting (the candidate and its kind), the median and p90 of |error| of tokens/s
and of the cost objective, before and after the tune's calibration; the tune's choice against the
sweep's best (tokens/s and the objective's J at cs), and the tune's measuring time against the sweep's.

The sweep runs for many minutes after the tune's calibration, and a shared VM's speed moves that much
(10-20% within half an hour here). So the sweep probes the machine every few points: target-only on the
first held-back prompts, the same work the calibration run did on them, whose forward time over the
calibration's is the machine's speed at that moment. Each swept point's error is also given with its
prediction scaled by that speed (`error_drift`, interpolated between probes): what the tune would have
predicted had its calibration been taken when the point ran. The headline figures stay the raw ones.

    python benchmarks/fidelity.py                                        # SmolLM2, bench + humaneval, local
    python benchmarks/fidelity.py --target qwen2.5-coder-1.5b --drafts qwen2.5-coder-0.5b prompt-lookup \\
        --worker tcp://127.0.0.1:5555 --clients 1 2 4 8
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from specbench.plan.explore import cost_column
from specbench.plan.predict import choose
from specbench.tune import TuneSpec, tune
from specbench.tune import phases
from specbench.tune.share import as_points

from common import RESULTS, write_report

PROBE_PROMPTS = 3  # held-back prompts a machine-speed probe decodes target-only
PROBE_EVERY = 4  # swept points between probes


def exhaustive(spec: TuneSpec, result, progress: bool) -> tuple[pd.DataFrame, float]:
    """Every point the tune predicted (one client; every load through a worker), measured on its held-back
    prompts with the tune's own target and drafts (reusing what the tune measured); the seconds the measuring
    took, the tune's own points included."""
    from specbench.tune.run import _method, _row
    from specbench.tune.share import measuring_s, sweep_points
    from specbench.tune.spec import candidate, split_prompts
    from specbench.datasets import load_prompts

    runner, drafts = result.calibrator.runner, result.calibrator.drafts
    rtt_ms = float(result.predicted["rtt_ms"].iloc[0])
    candidates = [candidate(name) for name in drafts]
    prompts = [row["prompt"] for row in load_prompts(spec.prompts, limit=spec.prompt_count, seed=spec.seed)]
    _, held = split_prompts(prompts, spec.calibration_share)
    store = phases.Store(result.folder)
    rows, seconds, spans = [], 0.0, []
    tuned = {row["label"]: row for row in result.measured.to_dict("records")}
    baseline = phases.measure(store, runner, candidates[0], "target-only", 0, held, None, spec, False)  # the tune's
    reference = float(baseline.loc[baseline["prompt_index"] < PROBE_PROMPTS, "target_forward_s"].median())
    probes = [probe(runner, held, spec, reference)]
    points = sweep_points(result.predicted, spec)
    window = result.predicted.assign(tokens_per_s=result.predicted["window_tokens_per_s"])
    raw = result.predicted.assign(tokens_per_s=result.predicted["raw_tokens_per_s"])
    for row in points.to_dict("records"):
        candidate, method = _method(row, candidates)
        clients = int(row["clients"])
        # priced as the tune would price it next: "per-point" re-times its widths just before it runs, the other
        # modes take the tune's last table ("runs": learned from every point the tune measured); the tune's own
        # points keep the errors they had when the tune measured them
        retimed = None if row["label"] in tuned else result.calibrator.refresh(candidate.name, int(row["k"]))
        at_run = result.predict_now(retimed) if retimed is not None else result.predicted
        began = time.monotonic()
        records = phases.measure(store, runner, candidate, method, int(row["k"]), held, drafts[candidate.name], spec,
                                 progress, clients=clients)
        seconds += measuring_s(records, clients)
        rows.append(tuned.get(row["label"]) or _row(row["candidate"], method, int(row["k"]), records, window, raw, spec,
                                                    rtt_ms, label=row["label"], at_run=at_run, clients=clients))
        spans.append(None if row["label"] in tuned else (began + time.monotonic()) / 2)  # the tune's: in its window
        if sum(span is not None for span in spans) % PROBE_EVERY == 0 and spans[-1] is not None:
            probes.append(probe(runner, held, spec, reference))
    probes.append(probe(runner, held, spec, reference))
    frame = pd.DataFrame(rows)
    when, speed = [t for t, _ in probes], [s for _, s in probes]
    frame["machine_speed"] = [1.0 if at is None else float(np.interp(at, when, speed)) for at in spans]
    frame["error_drift"] = frame["calibrated_tokens_per_s"] * frame["machine_speed"] / frame["measured_tokens_per_s"] - 1
    started = when[0]
    return frame, seconds, [(round((t - started) / 60, 2), round(s, 4)) for t, s in probes]


def probe(runner, held: list, spec: TuneSpec, reference_s: float) -> tuple[float, float]:
    """(when, the machine's speed against the calibration window): target-only on the first held-back prompts,
    the calibration run's own work on them (greedy: the same tokens), its median forward over theirs; above 1
    the machine runs faster now, and a prediction calibrated then should be scaled up by as much."""
    from specbench.api import run

    records = run(runner, held[:PROBE_PROMPTS], method="target-only", k=0, max_new_tokens=spec.max_new_tokens,
                  dtype=spec.dtype, seed=spec.seed, warmup=False, tokenizer=getattr(runner, "tokenizer", None),
                  progress=False)
    return time.monotonic(), reference_s / float(records["target_forward_s"].median())


def summary(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    frame = frame.assign(family=frame["candidate"] + " " + frame["method"])
    grouped = frame.groupby("family")
    quantile = lambda values, q: float(values.abs().quantile(q))  # noqa: E731
    return pd.DataFrame({
        "points": grouped.size(),
        "median_err_before": grouped["error_before"].apply(lambda v: quantile(v, 0.5)),
        "median_err_window": grouped["error_window"].apply(lambda v: quantile(v, 0.5)),
        "median_err_after": grouped["error_after"].apply(lambda v: quantile(v, 0.5)),
        "p90_err_after": grouped["error_after"].apply(lambda v: quantile(v, 0.9)),
        "p90_err_drift": grouped["error_drift"].apply(lambda v: quantile(v, 0.9)),
        # the cost objective (`column`, per token) as priced after calibration against its measured value
        "median_cost_err_after": grouped["cost_error_after"].apply(lambda v: quantile(v, 0.5)),
        "p90_cost_err_after": grouped["cost_error_after"].apply(lambda v: quantile(v, 0.9)),
    }).reset_index()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafts", nargs="+", default=["auto"])
    parser.add_argument("--datasets", nargs="+", default=["bench", "humaneval"])
    parser.add_argument("--prompt-count", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--calibration", default="runs", choices=("runs", "speed", "widths", "per-point"))
    parser.add_argument("--worker")
    parser.add_argument("--clients", type=int, nargs="+", default=[1])
    parser.add_argument("--cs", type=float, default=0.5)
    parser.add_argument("--cost", default="total_cost")
    parser.add_argument("--budget-minutes", type=float, default=15)
    parser.add_argument("--dtype", default="float32",
                        help="the drafts' (and a local target's) dtype; a worker's is its own")
    parser.add_argument("--out-dir", default=str(RESULTS / "fidelity"))
    parser.add_argument("--out", default=str(RESULTS / "fidelity.json"))
    args = parser.parse_args()

    rows, summaries, points = [], [], []
    for dataset in args.datasets:
        spec = TuneSpec(target=args.target, drafts=tuple(args.drafts), prompts=dataset, prompt_count=args.prompt_count,
                        endpoint=args.worker, clients=tuple(args.clients), objective=args.cost, cs=args.cs,
                        chain_ks=tuple(args.k), max_new_tokens=args.max_new_tokens, budget_minutes=args.budget_minutes,
                        calibration=args.calibration, dtype=args.dtype)
        started = time.perf_counter()
        result = tune(spec, f"{args.out_dir}/{args.target}-{dataset}")
        tune_s = time.perf_counter() - started
        sweep, sweep_measuring_s, probes = exhaustive(spec, result, progress=True)
        column = cost_column(args.cost)
        best = choose(as_points(sweep), args.cs, cost=column)
        chosen = sweep[sweep["label"] == result.chosen["label"]].iloc[0]
        row = {"dataset": dataset, "tune_s": round(tune_s, 1), "tune_measuring_s": result.seconds.get("measurements"),
               "sweep_measuring_s": round(sweep_measuring_s, 1), "points_predicted": len(result.predicted),
               "points_swept": len(sweep), "chosen": result.chosen["label"], "sweep_best": best["label"],
               "chosen_tokens_per_s": round(float(chosen["measured_tokens_per_s"]), 3),
               "best_tokens_per_s": round(float(best["measured_tokens_per_s"]), 3),
               "chosen_vs_best": round(float(chosen["measured_tokens_per_s"]) / float(best["measured_tokens_per_s"]), 3),
               "median_err_after": round(float(sweep["error_after"].abs().median()), 4),
               "p90_err_after": round(float(sweep["error_after"].abs().quantile(0.9)), 4),
               "median_err_drift": round(float(sweep["error_drift"].abs().median()), 4),
               "p90_err_drift": round(float(sweep["error_drift"].abs().quantile(0.9)), 4),
               "machine_speed_probes": probes,  # (minutes into the sweep, speed against the calibration window)
               "median_err_before": round(float(sweep["error_before"].abs().median()), 4),
               "median_err_window": round(float(sweep["error_window"].abs().median()), 4),
               "p90_err_window": round(float(sweep["error_window"].abs().quantile(0.9)), 4),
               "median_cost_err_after": round(float(sweep["cost_error_after"].abs().median()), 4),
               "p90_cost_err_after": round(float(sweep["cost_error_after"].abs().quantile(0.9)), 4),
               "calibration": result.calibration, "left_out": result.left_out}
        rows.append(row)
        summaries.append(summary(sweep, column).assign(dataset=dataset))
        points += sweep.assign(dataset=dataset).to_dict("records")
        print(pd.DataFrame([row]).drop(columns=["calibration", "left_out"]).T.to_string(), flush=True)
    table = pd.concat(summaries, ignore_index=True)
    print(table.round(4).to_string(index=False))
    write_report(args.out, {"target": args.target, "runs": rows, "families": table.to_dict("records"),
                            "points": points})


if __name__ == "__main__":
    main()
