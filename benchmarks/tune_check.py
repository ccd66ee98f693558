"""A tune's candidate points side by side: every method run per prompt in turn, in one `run` call, on the
tune's held-back prompts, greedy and at a temperature over seeds.

Why: a tune measures its points one after another, minutes apart, and a VM's speed moves more than two close
candidates differ (benchmarks/results/2026-12-03-tune-at-a-temperature.md); interleaved, the drift weighs on
every method alike. Prints tok/s as a ratio to target-only and tokens a step, and writes JSON.

    python benchmarks/tune_check.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 \
        --prompts mt-bench --prompt-count 16 --methods chain:3 prompt-lookup:3 suffix:3 --temperatures 0 0.8
"""
from __future__ import annotations

import argparse

import pandas as pd

from common import RESULTS, write_report
from specbench.api import as_target, run
from specbench.datasets import load_prompts
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.models.loading import as_loaded
from specbench.tune.spec import split_prompts
from specbench.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", help="the model draft of chain and tree methods")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--prompt-count", type=int, default=16, help="as the tune's: the second half is held back")
    parser.add_argument("--calibration-share", type=float, default=0.5)
    parser.add_argument("--methods", nargs="+", default=["chain:3", "prompt-lookup:3"])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="sampled passes' seeds (greedy: one)")
    parser.add_argument("--rule", default="rejection", choices=("rejection", "sample-match"))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(RESULTS / "tune_check.json"))
    args = parser.parse_args()

    rows = load_prompts(args.prompts, limit=args.prompt_count, seed=0)  # the tune's sample (its seed 0)
    _, held = split_prompts([row["prompt"] for row in rows], args.calibration_share)
    target, _ = as_target(args.target, args.dtype)
    draft = as_loaded(args.draft, args.dtype) if args.draft else None
    found = []
    for temperature in args.temperatures:
        for seed in args.seeds if temperature else args.seeds[:1]:
            sampling = SamplingParams(temperature=temperature, rule=args.rule) if temperature else SamplingParams()
            # each suffix drafter keeps only this call's outputs: a pass must not draft the last pass's answers
            records = run(target, held, method=["target-only", *args.methods], draft=draft, dtype=args.dtype,
                          max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed,
                          suffix=SuffixSettings(cache="drafter"), progress=f"t={temperature:g} seed {seed}")
            for method, steps in records.groupby("method"):
                seconds = steps["step_s"].sum() + steps.groupby("prompt_index")["prefill_s"].first().sum()
                found.append(dict(temperature=temperature, seed=seed, method=method,
                                  tokens=int(steps["emitted"].sum()), steps=len(steps), seconds=float(seconds)))
    table = pd.DataFrame(found)
    table["tokens_per_s"] = table["tokens"] / table["seconds"]
    table["tokens_per_step"] = table["tokens"] / table["steps"]
    base = table[table["method"] == "target-only"].set_index(["temperature", "seed"])["tokens_per_s"]
    table["x_target_only"] = [row.tokens_per_s / base[(row.temperature, row.seed)] for row in table.itertuples()]
    print(table.round(3).to_string(index=False))
    write_report(args.out, {"args": vars(args), "rows": table.to_dict("records")})


if __name__ == "__main__":
    main()
