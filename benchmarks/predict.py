"""Predicted vs measured: replay (profiles x acceptance reference x network) against real runs.

Profiles both models on this machine, records an acceptance reference (chain K=6, dynamic trees, and suffix
decoding's hybrid with the draft at each `--hybrid` budget) on the prompts, then runs each operating point for
real and prints the error of each prediction. Greedy on the reference's own prompts, every point's tokens a step
are the reference's: what is checked is the pricing of its steps (drafting, catch-up reads, verify widths).
Prediction never sees the measured run: the per-step orchestration overhead comes from a separate
target-only run. Remote points use a real worker on loopback with EMULATED RTT.

    python benchmarks/predict.py [--pair qwen|smollm2] [--prompts 3] [--max-new-tokens 32] [--save]
    python benchmarks/predict.py --pair qwen --dtype bfloat16 --dataset agentic --prompts 12 --max-new-tokens 40 \
        --hybrid 16 --suffix hand_over=0.5 other_k=3 catch_up=4

--save also writes the profiles and the reference into profiles/ and reference/ (what ships).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pandas as pd

from specbench.api import TreeShape, run
from specbench.datasets import load_prompts
from specbench.decode.suffix_drafter import suffix_options
from specbench.decode.metrics import time_split, tokens_per_second, tokens_per_step
from specbench.models.loading import load_model
from specbench.models.self_draft import truncated_view
from specbench.models.spec import ModelSpec
from specbench.plan.library import PROFILES, REFERENCES, save_profile, save_reference  # shipped: curated here
from specbench.plan.predict import OperatingPoint, predict
from specbench.record import profile_model, record_reference
from specbench.worker.client import NetworkEmulation, RemoteTarget
from specbench.worker.launch import free_port, spawn_worker

from common import write_report

ROOT = Path(__file__).resolve().parents[1]
TREE = TreeShape(max_depth=6, beam=4, branch=4)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=["qwen", "smollm2"], default="qwen")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rtt", type=float, default=50.0)
    parser.add_argument("--dataset", default="bench", help="a dataset name or a JSONL file of prompts")
    parser.add_argument("--hybrid", type=int, nargs="*", default=[16], help="suffix decoding's hybrid's budgets")
    parser.add_argument("--suffix", nargs="*", default=["hand_over=0.5", "other_k=3", "catch_up=4"],
                        metavar="KEY=VALUE", help="the hybrid's knobs (the tune's)")
    parser.add_argument("--head", help="a draft head's folder for the pair's target: its chains (eagle), trees "
                        "(eagle-tree) and hybrid (suffix-eagle-tree) instead of the draft model's; local points only")
    parser.add_argument("--save", action="store_true", help="write profiles/ and reference/ (the shipped caches)")
    parser.add_argument("--out", default=str(ROOT / "results" / "predict.json"))
    args = parser.parse_args()

    if args.pair == "qwen":
        target_spec = ModelSpec("qwen2.5-coder-1.5b", dtype=args.dtype)
        target = load_model(target_spec)
        draft = load_model(ModelSpec("qwen2.5-coder-0.5b", dtype=args.dtype))
    else:
        target_spec = ModelSpec("smollm2-135m", dtype=args.dtype)
        target = load_model(target_spec)
        draft = truncated_view(target, 26)
    prompts = [row["prompt"] for row in load_prompts(args.dataset, limit=args.prompts)]
    # up to 96: a hybrid's draft reads in one forward what suffix decoding's steps emitted since its last step
    grid = dict(tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32, 48, 64, 96), contexts=(128, 512), repeats=5)
    knobs = dict(suffix_options(args.suffix), cache="drafter")

    chain, tree, hybrid = ("eagle", "eagle-tree", "suffix-eagle-tree") if args.head else (
        "chain", "tree", "suffix-tree-chain")

    print("profiling target and draft ...", flush=True)
    target_profile, target_meta = profile_model(target, **grid)
    if args.head:  # a head's forward over n new positions after a cache of c, over the same grid
        from specbench.heads.layouts import load_head
        from specbench.heads.profile import head_label, profile_head

        draft = args.head
        draft_profile, draft_meta = profile_head(load_head(draft, target), head_label(draft), tokens=grid["tokens"],
                                                 contexts=grid["contexts"], repeats=grid["repeats"])
    else:
        draft_profile, draft_meta = profile_model(draft, **grid)
    print("recording the acceptance reference ...", flush=True)
    reference = record_reference(target, draft, prompts, dataset=args.dataset, max_chain=6, tree_budgets=args.budgets,
                                 max_new_tokens=args.max_new_tokens, tree=TREE, hybrid_budgets=args.hybrid,
                                 hybrid_suffix=knobs)
    if args.save:
        for profile, meta in ((target_profile, target_meta), (draft_profile, draft_meta)):
            print("saved", save_profile(profile, meta, folder=PROFILES))
        print("saved", save_reference(reference, {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens}, folder=REFERENCES))

    print("measuring ...", flush=True)
    baseline = run(target, prompts, method="target-only", max_new_tokens=args.max_new_tokens, progress=False)
    overhead_s = time_split(baseline)["overhead_s"]
    context = int(baseline["prompt_tokens"].mean() + args.max_new_tokens / 2)
    points = [OperatingPoint("target-only")] + [OperatingPoint(chain, k) for k in (2, 4, 6)]
    points += [OperatingPoint(tree, b) for b in args.budgets]
    points += [OperatingPoint(hybrid, b) for b in args.hybrid]
    measured = {points[0].label: baseline}
    for point in points[1:]:
        measured[point.label] = run(target, prompts, method=point.method, draft=draft, k=point.k, tree=TREE,
                                    max_new_tokens=args.max_new_tokens, progress=False, suffix=knobs)
    if not args.head:  # a head drafting on the client of a worker needs its own embeddings: not measured here
        measure_remote(args, target_spec, target, draft, prompts, knobs, points, measured)

    rows = []
    for point in points:
        [predicted] = predict([point], target_profile, draft_profile, reference, context=context, overhead_s=overhead_s)
        records = measured[point.label]
        rows.append({"point": point.label, "predicted_tps": predicted["tokens_per_s"],
                     "measured_tps": tokens_per_second(records),
                     "tps_error": predicted["tokens_per_s"] / tokens_per_second(records) - 1,
                     "predicted_tokens_per_step": predicted["tokens_per_step"],
                     "measured_tokens_per_step": tokens_per_step(records),
                     "tokens_per_step_error": predicted["tokens_per_step"] / tokens_per_step(records) - 1})
    table = pd.DataFrame(rows)
    median_error = statistics.median(abs(e) for e in table["tps_error"])
    pd.set_option("display.width", 200)
    print(f"\n== predicted vs measured ({args.pair}, {args.dtype}, {len(prompts)} prompts x {args.max_new_tokens} "
          f"tokens, context ~{context}, overhead {1000 * overhead_s:.2f} ms/step from target-only) ==")
    print(table.round(3).to_string(index=False))
    print(f"median |tokens/s error| = {median_error:.1%} (goal <= 10%)")
    write_report(args.out, {"pair": args.pair, "settings": vars(args), "rows": rows,
                            "median_abs_tps_error": median_error,
                            "note": f"remote points: loopback worker with EMULATED RTT {args.rtt} ms"})


def measure_remote(args, target_spec, target, draft, prompts, knobs, points, measured) -> None:
    """Target-only, chain K=4 and the hybrid through a worker on loopback at an emulated `--rtt`."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(endpoint, "--model", target_spec.model, "--dtype", args.dtype)
    try:
        remote = RemoteTarget(endpoint, network=NetworkEmulation(rtt_ms=args.rtt), timeout_s=300)
        remotes = [OperatingPoint("target-only", 0, "remote", args.rtt), OperatingPoint("chain", 4, "remote", args.rtt)]
        remotes += [OperatingPoint("suffix-tree-chain", b, "remote", args.rtt) for b in args.hybrid]
        for point in remotes:
            measured[point.label] = run(remote, prompts, method=point.method, draft=draft, k=point.k, tree=TREE,
                                        max_new_tokens=args.max_new_tokens, progress=False, tokenizer=target.tokenizer,
                                        suffix=knobs)
            points.append(point)
    finally:
        worker.terminate()


if __name__ == "__main__":
    main()
