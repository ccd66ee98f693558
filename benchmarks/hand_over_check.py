"""Held-out check of a hybrid's hand-over: `suffix-tree-chain` at two hand-overs side by side on workload.py's
held-out requests (same request set and split), method order alternating per family, one pass.

    python benchmarks/hand_over_check.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --spec-bench .../question-6.jsonl --per-family 2 --sessions 2 --hand-overs 1.0 2.0
"""
from __future__ import annotations

import argparse
import time

import pandas as pd

from specbench.api import outputs, run
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.decode.target import LocalTarget
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec

from common import RESULTS, write_report
from workload import per_prompt, requests, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--spec-bench")
    parser.add_argument("--per-family", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--sharegpt-sessions", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--hand-overs", type=float, nargs=2, default=[1.0, 2.0])
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--other-k", type=int, default=3)
    parser.add_argument("--kernels", default="tuned")
    parser.add_argument("--out", default=str(RESULTS / "hand_over_check.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    target = LocalTarget(load_model(ModelSpec(args.target, kernels=args.kernels)))
    draft = load_model(ModelSpec(args.draft, kernels=args.kernels))
    _, held = split(requests(args, target))
    rows, made = [], {}
    for number, family in enumerate(sorted(set(r["set"] for r in held))):
        prompts = [r for r in held if r["set"] == family]
        order = args.hand_overs if number % 2 == 0 else args.hand_overs[::-1]
        for hand_over in order:
            settings = SuffixSettings(name=f"check {hand_over}", factor=2.0, offset=1.0, hand_over=hand_over,
                                      other_k=args.other_k)
            records = run(target, [r["ids"] for r in prompts], method="suffix-tree-chain", k=args.k, draft=draft,
                          max_new_tokens=args.max_new_tokens, warmup=number == 0, progress=False, suffix=settings)
            for (_, index), produced in outputs(records).items():
                made[(hand_over, f"{family}/{index}")] = produced
            for item in per_prompt(records).itertuples():
                rows.append({"family": family, "hand_over": hand_over, "prompt": f"{family}/{item.prompt_index}",
                             "tokens": item.tokens, "steps": item.steps, "seconds": item.seconds})
        print(f"{family}: done")
    frame = pd.DataFrame(rows)
    table = frame.groupby("hand_over").agg(tokens=("tokens", "sum"), steps=("steps", "sum"), seconds=("seconds", "sum"))
    table["tok/s"], table["tok/step"] = table.tokens / table.seconds, table.tokens / table.steps
    print(table.round(3).to_string())
    low, high = args.hand_overs
    same = sum(made[(low, prompt)] == made[(high, prompt)] for hand_over, prompt in made if hand_over == low)
    print(f"outputs equal between the two hand-overs: {same} of {len(made) // 2}")
    write_report(args.out, {"args": vars(args), "table": table.reset_index().to_dict("records"),
                            "rows": rows, "outputs_equal": same, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
