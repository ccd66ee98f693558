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
    python benchmarks/router_refit.py results/wl-qwen-6.json --ridge 10 --margins 0 --seen on \
        --time suffix-tree-chain:16 --passes 2    # the first refit's `auto`, timed beside the hybrid

`--time` decodes again: the held-out prompts in the run's order, the first refit router's `auto` and the named fixed
candidates interleaved (run rotates their order per prompt; every pass with fresh suffix caches), with the run's
target, draft and suffix knobs. A refit scored on the rows picks from timings it did not make; timed, it answers
for its own.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd

import specbench.route.router as router_module
from common import RESULTS, write_report
from specbench.route.auto import candidates_from
from specbench.route.features import prompt_features, seen_shares
from specbench.route.router import BY_FAMILY, fit_router, parse_margin


def history_turns(ids) -> float:
    """How many times the prompt's last 3 ids occur earlier in it: in a chat, the assistant header that ends
    every prompt, once per earlier answer the prompt holds."""
    ids = list(ids)
    tail = tuple(ids[-3:])
    return float(np.log1p(sum(tuple(ids[i:i + 3]) == tail for i in range(len(ids) - 3))))


FEATURES = {"default": prompt_features,
            "history": lambda ids, family=None, families=(), seen=0.0: np.append(
                prompt_features(ids, family, families, seen), history_turns(ids))}


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


def seen_in_order(requests: list[dict]) -> list[float]:
    """Each request's seen share against the outputs of those before it, as a run's fresh cache holds them (the
    target's own answers kept beside the requests; a request without one adds nothing)."""
    return seen_shares([r["ids"] for r in requests], [r.get("output", []) for r in requests])


def score(router, rows: pd.DataFrame, held: dict[str, dict], seen: dict[str, float]) -> dict:
    """The router's choice for every held-out prompt, scored with that prompt's measured row of it."""
    fixed = rows[rows["label"] != "auto"]
    chosen = {name: router.choose(request["ids"], request["set"], seen[name])[0].label
              for name, request in held.items()}
    picked = fixed[fixed["label"] == fixed["prompt"].map(chosen)]
    speeds = {label: chunk.tokens.sum() / chunk.seconds.sum() for label, chunk in fixed.groupby("label")}
    best_label = max(speeds, key=speeds.get)
    speed = picked.tokens.sum() / picked.seconds.sum()
    return {"tok_s": speed, "over_best_fixed": speed / speeds[best_label], "best_fixed": best_label,
            "default": router.default, "margin": router.margin, "by family": router.by_family,
            "choices": pd.Series(chosen).value_counts().to_dict()}


def group_ceilings(rows: pd.DataFrame, seen: dict[str, float]) -> pd.DataFrame:
    """What a router that gives every prompt of a group one candidate can earn at best, per pass: each group's
    candidate chosen on the same pass (the group oracle) and on the other pass (cross-fitted), over the best fixed
    method of the pass. Groups: the family, and the family split by whether earlier outputs hold part of the
    prompt (a session's first turn against its later ones). Per-prompt headroom beyond these lies within groups."""
    from workload import _speeds

    fixed = rows[rows["label"] != "auto"].assign(quoted=lambda d: d["prompt"].map(seen).fillna(0.0) > 0)

    def speed(chunk):
        return chunk.tokens.sum() / chunk.seconds.sum()

    def best(chunk):
        pace = _speeds(chunk)
        return max(pace, key=pace.get)
    lines = []
    for grouping in (["family"], ["family", "quoted"]):
        for turn in sorted(set(fixed["pass"])):
            mine, other = fixed[fixed["pass"] == turn], fixed[fixed["pass"] != turn]
            line = {"groups": " x ".join(grouping), "pass": turn}
            for name, source in (("same pass", mine), ("cross-fitted", other)):
                if not len(source):
                    continue
                choice = {key: best(group) for key, group in source.groupby(grouping)}
                picked = pd.concat([chunk[chunk.label == choice[key]] for key, chunk in mine.groupby(grouping)])
                line[f"{name} over best fixed"] = speed(picked) / speed(mine[mine.label == best(mine)])
            lines.append(line)
    return pd.DataFrame(lines)


def time_router(router, report: dict, held: dict[str, dict], fixed: list[str], passes: int) -> dict:
    """`auto` with `router` and the `fixed` candidates over the held-out prompts, interleaved, `passes` times:
    tok/s per label (tokens over prefill, steps and routing, pooled) overall and per pass, and auto's choices."""
    from workload import per_prompt

    from specbench.api import run
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.decode.target import LocalTarget
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    args = report["args"]
    target = LocalTarget(load_model(ModelSpec(args["target"], dtype=args["dtype"], kernels=args["kernels"])))
    draft = load_model(ModelSpec(args["draft"], dtype=args["draft_dtype"] or args["dtype"], kernels=args["kernels"])) \
        if args.get("draft") else None
    knobs = dict(factor=args["suffix_factor"], offset=args["suffix_offset"], min_prob=args["suffix_min_prob"],
                 min_score=report["suffix_min_score"], hand_over=report["hand_over"], other_k=args["other_k"],
                 catch_up=float(report.get("catch_up", "inf")))
    prompts = list(held.values())
    ids, families = [r["ids"] for r in prompts], [r["set"] for r in prompts]
    methods = fixed + ["auto"]
    frames, chosen = [], []
    for turn in range(passes):
        records = run(target, ids, method=methods if turn % 2 == 0 else methods[::-1], k=4, draft=draft,
                      router=router, families=families, max_new_tokens=args["max_new_tokens"], warmup=turn == 0,
                      progress=f"timed, pass {turn + 1}/{passes}", suffix=SuffixSettings(name=f"timed {turn}", **knobs))
        frames.append(per_prompt(records).assign(turn=turn))
        chosen += records[records["method"] == "auto"].groupby("prompt_index")["chosen"].first().tolist()
    table = pd.concat(frames)

    def speeds(rows):
        return {method: rows[rows.method == method].tokens.sum() / rows[rows.method == method].seconds.sum()
                for method in sorted(set(rows.method))}
    overall = speeds(table)
    best = max((m for m in overall if m != "auto"), key=overall.get)
    return {"tok_s": overall, "by_pass": {turn: speeds(rows) for turn, rows in table.groupby("turn")},
            "auto_over_best_fixed": overall["auto"] / overall[best], "best_fixed": best,
            "auto_choices": pd.Series(chosen).value_counts().to_dict(), "rows": table.to_dict("records")}


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
    parser.add_argument("--seen", nargs="+", default=["on"], choices=["on", "off"],
                        help="give the router each prompt's seen share (how much of it earlier outputs hold), or 0")
    parser.add_argument("--time", nargs="+", metavar="CANDIDATE",
                        help="decode again: the first refit's auto beside these fixed candidates (method:K) on the "
                             "held-out prompts (see above)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--ceilings", action="store_true",
                        help="also print what one candidate per family (and per family and first or later turn) "
                             "earns at best on the held-out rows, chosen on the same or the other pass")
    parser.add_argument("--report", default=str(RESULTS / "router-timed.json"), help="--time's JSON report")
    args = parser.parse_args()
    report, records, calibration, held = load_run(Path(args.out))
    rows = pd.DataFrame(report["rows"])
    candidates = candidates_from(report["args"]["candidates"])
    prompts = [request["ids"] for request in calibration]
    families = [request["set"] for request in calibration] if args.families else None
    if not args.families:
        held = {name: dict(request, set=None) for name, request in held.items()}
    measured_auto = rows[rows["label"] == "auto"]
    shares = {"on": (seen_in_order(calibration), dict(zip(held, seen_in_order(list(held.values()))))),
              "off": (None, dict.fromkeys(held, 0.0))}
    lines = []
    try:  # the router reads its features through its module's name: swapped for each set, put back after
        for features in args.features:
            router_module.prompt_features = FEATURES[features]
            for seen, ridge, margin, by_family in itertools.product(args.seen, args.ridge, args.margins,
                                                                    args.by_family):
                router = fit_router(records, prompts, candidates, families, ridge=ridge, margin=parse_margin(margin),
                                    by_family=BY_FAMILY[by_family], seen=shares[seen][0])
                lines.append({"features": features, "seen": seen, "ridge": ridge, "margin asked": margin,
                              "by family asked": by_family, **score(router, rows, held, shares[seen][1])})
    finally:
        router_module.prompt_features = prompt_features
    frame = pd.DataFrame(lines)
    print(f"{args.out}: {len(calibration)} calibration, {len(held)} held-out prompts; auto as run: "
          f"{measured_auto.tokens.sum() / max(measured_auto.seconds.sum(), 1e-12):.3f} tok/s")
    print(frame.round(3).to_string(index=False))
    if args.ceilings:
        print(group_ceilings(rows, shares["on"][1]).round(4).to_string(index=False))
    if args.time:
        first = lines[0]
        if first["features"] != "default":
            raise SystemExit("--time decodes with the package's own features: give --features default first")
        router = fit_router(records, prompts, candidates, families, ridge=first["ridge"],
                            margin=parse_margin(first["margin asked"]), by_family=BY_FAMILY[first["by family asked"]],
                            seen=shares[first["seen"]][0])
        timed = time_router(router, report, held, args.time, args.passes)
        print(json.dumps({k: v for k, v in timed.items() if k != "rows"}, indent=1, default=str))
        write_report(args.report, {"refit": {k: v for k, v in first.items() if k != "choices"}, "run": args.out,
                                   "args": vars(args), **timed})


if __name__ == "__main__":
    main()
