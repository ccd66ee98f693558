"""Fit a router anew on a `workload.py` run's calibration records and score it on that run's held-out rows.

Why: the held-out half of a workload run times every candidate on every prompt, so any router fitted on the
calibration half alone can be scored there without decoding again: its choice per prompt is looked up in the
rows (tokens over seconds of the chosen candidate, pooled as `workload.py` pools them). A run takes an hour
with a 1.5B target on a CPU; trying a ridge strength, a margin or a feature set takes seconds here.

Reads OUT.json (the rows), OUT.calibration-records.pkl, OUT.calibration.json (the calibration requests) and
OUT.held-out.json (the held-out requests, written since 2026-12-02).

    python benchmarks/router_refit.py results/wl-qwen-amx.json
    python benchmarks/router_refit.py results/wl-qwen-amx.json --ridge 0.1 1 10 --margins learn 0 inf
    python benchmarks/router_refit.py results/wl-qwen-amx.json --margins learn inf --by-family learn on off
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

import specbench.route.router as router_module
from specbench.route.auto import candidates_from
from specbench.route.features import prompt_features
from specbench.route.router import BY_FAMILY, fit_router, parse_margin


def history_turns(ids) -> float:
    """How many times the prompt's last 3 ids occur earlier in it: in a chat, the assistant header that ends
    every prompt, once per earlier answer the prompt holds."""
    ids = list(ids)
    tail = tuple(ids[-3:])
    return float(np.log1p(sum(tuple(ids[i:i + 3]) == tail for i in range(len(ids) - 3))))


FEATURES = {"default": prompt_features,
            "history": lambda ids, family=None, families=(): np.append(prompt_features(ids, family, families),
                                                                      history_turns(ids))}


def load_run(out: Path) -> tuple[dict, pd.DataFrame, list[dict], dict[str, dict]]:
    """(the report, the calibration records, the calibration requests, the held-out requests by prompt name)."""
    report = json.loads(out.read_text())
    missing = [path for path in (out.with_suffix(".calibration-records.pkl"), out.with_suffix(".calibration.json"),
                                 out.with_suffix(".held-out.json")) if not path.exists()]
    if missing:
        raise SystemExit(f"{out}: missing {[str(p) for p in missing]} (runs before 2026-12-02 kept no held-out "
                         f"requests; a run without target-only keeps no calibration requests)")
    return (report, pd.read_pickle(out.with_suffix(".calibration-records.pkl")),
            json.loads(out.with_suffix(".calibration.json").read_text()),
            json.loads(out.with_suffix(".held-out.json").read_text()))


def score(router, rows: pd.DataFrame, held: dict[str, dict]) -> dict:
    """The router's choice for every held-out prompt, scored with that prompt's measured row of it."""
    fixed = rows[rows["label"] != "auto"]
    chosen = {name: router.choose(request["ids"], request["set"])[0].label for name, request in held.items()}
    picked = fixed[fixed["label"] == fixed["prompt"].map(chosen)]
    speeds = {label: chunk.tokens.sum() / chunk.seconds.sum() for label, chunk in fixed.groupby("label")}
    best_label = max(speeds, key=speeds.get)
    speed = picked.tokens.sum() / picked.seconds.sum()
    return {"tok_s": speed, "over_best_fixed": speed / speeds[best_label], "best_fixed": best_label,
            "default": router.default, "margin": router.margin, "by family": router.by_family,
            "choices": pd.Series(chosen).value_counts().to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a workload.py run's JSON (its sidecar files beside it)")
    parser.add_argument("--ridge", type=float, nargs="+", default=[1.0])
    parser.add_argument("--margins", nargs="+", default=["learn"], help="shares, 'inf' or 'learn'")
    parser.add_argument("--families", action=argparse.BooleanOptionalAction, default=True,
                        help="give the router each prompt's family (a one-hot feature per family)")
    parser.add_argument("--by-family", nargs="+", default=["learn"], choices=list(BY_FAMILY),
                        help="start each prompt from its family's measured default: cross-validated, or forced")
    parser.add_argument("--features", nargs="+", default=["default"], choices=["default", "history"],
                        help="feature sets to compare; history: the default's and how many earlier turns the "
                             "prompt holds (earlier copies of its last 3 ids, a chat template's assistant header)")
    args = parser.parse_args()
    report, records, calibration, held = load_run(Path(args.out))
    rows = pd.DataFrame(report["rows"])
    candidates = candidates_from(report["args"]["candidates"])
    prompts = [request["ids"] for request in calibration]
    families = [request["set"] for request in calibration] if args.families else None
    if not args.families:
        held = {name: dict(request, set=None) for name, request in held.items()}
    measured_auto = rows[rows["label"] == "auto"]
    lines = []
    try:  # the router reads its features through its module's name: swapped for each set, put back after
        for features in args.features:
            router_module.prompt_features = FEATURES[features]
            for ridge in args.ridge:
                for margin in args.margins:
                    for by_family in args.by_family:
                        router = fit_router(records, prompts, candidates, families, ridge=ridge,
                                            margin=parse_margin(margin),
                                            by_family=BY_FAMILY[by_family])
                        lines.append({"features": features, "ridge": ridge, "margin asked": margin,
                                      "by family asked": by_family, **score(router, rows, held)})
    finally:
        router_module.prompt_features = prompt_features
    frame = pd.DataFrame(lines)
    print(f"{args.out}: {len(calibration)} calibration, {len(held)} held-out prompts; auto as run: "
          f"{measured_auto.tokens.sum() / max(measured_auto.seconds.sum(), 1e-12):.3f} tok/s")
    print(frame.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
