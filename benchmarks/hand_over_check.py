"""Held-out check of a hybrid's knobs: `suffix-tree-chain` at several hand-overs or catch-ups, side by side.

The replays of `route.hand_over` price each knob from a calibration run; this times them. Every prompt runs every
variant (and the baselines, e.g. target-only and suffix-tree) back to back, their order rotated per prompt and
reversed on the second pass, so a slow spell of the machine falls on all alike; each variant keeps its own suffix
cache (fresh on each pass). Requests: workload.py's held-out half, scripted anew, or read from the
`.held-out.json` a workload run wrote beside its report (`--requests`).

    python benchmarks/hand_over_check.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --spec-bench .../question-6.jsonl --per-family 2 --sessions 2 --hand-overs 1.0 2.0
    python benchmarks/hand_over_check.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 \
        --draft-dtype float32 --requests results/wl.held-out.json --hand-overs 0.5 --catch-ups inf 4 \
        --baselines target-only suffix-tree --passes 2
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import pandas as pd

from specbench.api import outputs, run
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.decode.target import LocalTarget
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec

from common import RESULTS, write_report
from workload import per_prompt, prompt_names, requests, split, unlike_target_only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--spec-bench")
    parser.add_argument("--per-family", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--sharegpt-sessions", type=int, default=0)
    parser.add_argument("--requests", help="a workload run's .held-out.json: its requests, not scripted anew")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--hand-overs", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--catch-ups", type=float, nargs="+", default=[math.inf])
    parser.add_argument("--baselines", nargs="*", default=[], help="methods timed beside the variants "
                        "(target-only: held-out outputs checked against it)")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--other-k", type=int, default=3)
    parser.add_argument("--kernels", default="tuned")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft-dtype", help="the draft's dtype (default: --dtype)")
    parser.add_argument("--passes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--out", default=str(RESULTS / "hand_over_check.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    loaded = load_model(ModelSpec(args.target, dtype=args.dtype, kernels=args.kernels))
    target = LocalTarget(loaded)
    draft = load_model(ModelSpec(args.draft, dtype=args.draft_dtype or args.dtype, kernels=args.kernels))
    if args.requests:
        named = json.loads(open(args.requests).read())
    else:
        held = split(requests(args, target))[1]
        named = dict(zip(prompt_names(held), held))
    variants = [(f"hybrid h={h:g} c={c:g}", "suffix-tree-chain", {"hand_over": h, "catch_up": c})
                for h, c in itertools.product(args.hand_overs, args.catch_ups)]
    runs = variants + [(method, method, {}) for method in args.baselines]

    def one(label, method, knobs, ids, cache):
        suffix = SuffixSettings(name=cache, factor=2.0, offset=1.0, other_k=args.other_k, **knobs)
        return run(target, [ids], method=method, k=args.k, draft=draft, max_new_tokens=args.max_new_tokens,
                   warmup=False, progress=False, suffix=suffix)

    first = next(iter(named.values()))["ids"]
    for label, method, knobs in runs:  # warm each once, its cache a throwaway one
        one(label, method, knobs, first, f"warm {label}")
    rows, made = [], {}
    for turn in range(args.passes):
        for number, (name, request) in enumerate(named.items()):
            order = runs[number % len(runs):] + runs[:number % len(runs)]
            for label, method, knobs in (order if turn == 0 else order[::-1]):
                records = one(label, method, knobs, request["ids"], f"pass {turn} {label}")
                made[(label, turn, name)] = outputs(records)[(method, 0)]
                line = per_prompt(records).iloc[0]
                rows.append({"label": label, "pass": turn, "prompt": name, "family": name.split("/")[0],
                             "tokens": int(line.tokens), "steps": int(line.steps), "seconds": float(line.seconds)})
        print(f"pass {turn + 1}: done ({time.perf_counter() - started:.0f} s)")
    frame = pd.DataFrame(rows)
    table = frame.groupby("label").agg(tokens=("tokens", "sum"), steps=("steps", "sum"), seconds=("seconds", "sum"))
    table["tok/s"], table["tok/step"] = table.tokens / table.seconds, table.tokens / table.steps
    table[f"x {variants[0][0]}"] = table["tok/s"] / table.loc[variants[0][0], "tok/s"]
    print(table.round(3).to_string())
    by = frame.groupby(["family", "label"])[["tokens", "seconds"]].sum()
    families = (by.tokens / by.seconds).unstack()
    passes = frame.groupby(["pass", "label"])[["tokens", "seconds"]].sum()
    print(families.round(2).to_string())
    unlike = unlike_target_only(made, loaded.model, {name: request["ids"] for name, request in named.items()})
    print(f"outputs unlike target-only's: {unlike}")
    write_report(args.out, {"args": vars(args), "table": table.reset_index().to_dict("records"),
                            "families": families.reset_index().to_dict("records"),
                            "passes": (passes.tokens / passes.seconds).unstack().reset_index().to_dict("records"),
                            "rows": rows, "outputs_unlike_target_only": unlike,
                            "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
