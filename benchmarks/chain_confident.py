"""chain-confident's threshold against the best fixed K, side by side: one interleaved `run` per threshold, with
`chain:K` beside `chain-confident:CAP` in it, so each ratio is read within one call (the box's drift between calls
moves both). Greedy, or sampled at --temperature (rejection, seeded); prints a table and writes JSON.

    python benchmarks/chain_confident.py --stop-below 0.4 0.6 0.8 0.9 [--k 2] [--cap 12] [--prompts 6]
        [--temperature 0.8 --seed 0]
"""
from __future__ import annotations

import argparse

import pandas as pd
from tqdm.auto import tqdm

from specbench.api import run
from specbench.decode.metrics import summarize
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec
from specbench.types import SamplingParams

from common import RESULTS, bench_prompts, write_report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--stop-below", type=float, nargs="+", default=[0.4, 0.6, 0.8, 0.9])
    parser.add_argument("--k", type=int, default=2, help="the fixed chain beside it (the best K measured here)")
    parser.add_argument("--cap", type=int, default=12, help="chain-confident's K")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else rejection sampling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "chain_confident.json"))
    args = parser.parse_args()
    target = load_model(ModelSpec(args.target, dtype=args.dtype))
    draft = load_model(ModelSpec(args.draft, dtype=args.dtype))
    prompts = bench_prompts(args.prompts)
    sampling = SamplingParams(temperature=args.temperature, rule="rejection") if args.temperature else None
    rows = []
    for stop_below in tqdm(args.stop_below, desc="thresholds"):
        records = run(target, prompts, method=[f"chain:{args.k}", f"chain-confident:{args.cap}"], draft=draft,
                      max_new_tokens=args.max_new_tokens, stop_below=stop_below, dtype=args.dtype, progress=False,
                      sampling=sampling, seed=args.seed)
        table = summarize(records).set_index("method")
        drafted = records.groupby("method")["drafted"].mean()
        fixed, confident = table.loc["chain"], table.loc["chain-confident"]
        rows.append({"stop_below": stop_below, "chain_tok_s": fixed["tokens_per_s"],
                     "confident_tok_s": confident["tokens_per_s"],
                     "ratio": confident["tokens_per_s"] / fixed["tokens_per_s"],
                     "chain_tokens_per_step": fixed["tokens_per_step"],
                     "confident_tokens_per_step": confident["tokens_per_step"],
                     "confident_drafted_per_step": drafted["chain-confident"],
                     "confident_acceptance": confident["acceptance_rate"]})
    frame = pd.DataFrame(rows)
    how = f"T={args.temperature:g} rejection" if sampling else "greedy"
    print(f"\nchain K={args.k} beside chain-confident K<={args.cap} ({args.target} <- {args.draft}, {args.dtype}, "
          f"{how}, {len(prompts)} prompts x {args.max_new_tokens} tokens; one call a threshold)")
    print(frame.round(3).to_string(index=False))
    write_report(args.out, {"settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
