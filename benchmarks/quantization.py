"""Quantization as an axis: speed, memory, acceptance and prediction error of quantized drafts and targets, one run.

Per model variant (bitsandbytes 8bit / 4bit, PyTorch int8-dynamic, unquantized): weight bytes and KV
bytes per token as loaded, its forward latency profile on this machine, target-only tokens/s (and, for
a quantized target, how many of its greedy tokens match the fp32 target's: quantizing the target is
lossy), and as a draft of the family's fp32 target: the draft cost ratio c (draft forward / target
forward, one token at the prompts' context), acceptance rate and tokens/step of chains K=2 and K=4
next to the unquantized draft's, whether greedy SD output equals target-only's (it must), and the
predicted tokens/s of those chains (profiles x an acceptance reference recorded here) against the
measured ones.

    python benchmarks/quantization.py [--family smollm2|qwen] [--prompts 3] [--max-new-tokens 32] [--save]

--save writes the profiles and references into profiles/ and reference/ (what ships): the bench reference
the comparison recorded, plus one per --reference-datasets set.
"""
from __future__ import annotations

import argparse
import gc
from dataclasses import replace
import statistics
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from specbench.api import TreeShape, encode_prompts, outputs, run
from specbench.datasets import load_prompts
from specbench.decode.metrics import time_split, tokens_per_second, tokens_per_step
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec
from specbench.plan.library import PROFILES, REFERENCES, load_profiles, save_profile, save_reference  # shipped: curated here
from specbench.plan.predict import OperatingPoint, predict
from specbench.record import profile_model, record_reference

from common import write_report

ROOT = Path(__file__).resolve().parents[1]
TREE = TreeShape(max_depth=6, beam=4, branch=4)
FAMILIES = {
    # SubSpec's idea for SmolLM2: the target itself, quantized, as its own draft (unquantized: c = 1, all accepted)
    "smollm2": {"target": "smollm2-135m", "draft": "smollm2-135m", "target_quants": ("8bit", "4bit", "int8-dynamic"),
                "draft_quants": ("none", "8bit", "4bit", "int8-dynamic")},
    "qwen": {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b", "target_quants": ("8bit", "int8-dynamic"),
             "draft_quants": ("none", "8bit", "4bit", "int8-dynamic")},
}
GRID = dict(tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32), contexts=(128, 512), repeats=5)
KS = (2, 4)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="smollm2")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--save", action="store_true", help="write profiles/ and reference/ (the shipped caches)")
    parser.add_argument("--reference-datasets", nargs="*", default=[],
                        help="with --save, also record each draft's reference on these prompt sets (the bench "
                             "reference of the comparison itself is always saved)")
    parser.add_argument("--reference-prompts", type=int, default=6)
    parser.add_argument("--reference-tokens", type=int, default=64)
    parser.add_argument("--reference-budgets", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(GRID["tokens"]),
                        help="profile grid: tokens per forward (contexts 128 and 512, 5 repeats, 2 passes)")
    parser.add_argument("--target-quants", nargs="*", help="default: the family's (see FAMILIES)")
    parser.add_argument("--draft-quants", nargs="*", help="default: the family's")
    parser.add_argument("--out", default=str(ROOT / "results" / "quantization.json"))
    args = parser.parse_args()
    family = dict(FAMILIES[args.family])
    GRID["tokens"] = tuple(args.tokens)
    family["target_quants"] = args.target_quants if args.target_quants is not None else family["target_quants"]
    family["draft_quants"] = args.draft_quants if args.draft_quants is not None else family["draft_quants"]

    target = load_model(ModelSpec(family["target"]))
    prompts = encode_prompts([row["prompt"] for row in load_prompts("bench", limit=args.prompts)], target.tokenizer)
    baseline = run(target, prompts, method="target-only", max_new_tokens=args.max_new_tokens, progress=False)
    expected = {index: tokens for (_, index), tokens in outputs(baseline).items()}
    overhead_s = time_split(baseline)["overhead_s"]
    context = int(baseline["prompt_tokens"].mean() + args.max_new_tokens / 2)
    target_profile, target_meta = steady_profile(target)
    shipped = any(p.model == target_profile.model and p.device == target_profile.device for p in load_profiles())
    # label -> (profile, metadata to save it with); the fp32 target is saved only where none ships for this device
    variants = {target.spec.label: (target_profile, None if shipped else target_meta)}
    if args.save and not shipped:
        print("saved", save_profile(target_profile, target_meta, folder=PROFILES), flush=True)
    memory_rows = [variant_row(target, target_profile, target_profile, baseline, expected, context)]
    specs = [ModelSpec(family["target"], quantization=q) for q in family["target_quants"]]
    specs += [ModelSpec(family["draft"], quantization=q) for q in family["draft_quants"]]
    for spec in tqdm([s for i, s in enumerate(specs) if s not in specs[:i] and s != target.spec], desc="variants"):
        loaded = load_model(spec)
        profile, meta = steady_profile(loaded)
        records = run(loaded, prompts, method="target-only", max_new_tokens=args.max_new_tokens, progress=False)
        same_model = spec.model == family["target"]
        memory_rows.append(variant_row(loaded, profile, target_profile, records, expected if same_model else None,
                                       context))
        variants[spec.label] = (profile, meta)
        if args.save:  # saved as measured: a run cut short keeps what it finished
            print("saved", save_profile(profile, meta, folder=PROFILES), flush=True)
        del loaded
        gc.collect()

    draft_rows, prediction_rows = [], []
    for quant in tqdm(family["draft_quants"], desc="drafts"):
        spec = ModelSpec(family["draft"], quantization=quant)
        draft = target if spec == target.spec else load_model(spec)
        profile = variants[spec.label][0]
        reference = record_reference(target, draft, [row["prompt"] for row in load_prompts("bench", limit=args.prompts)],
                                     dataset="bench", max_chain=6, tree_budgets=args.budgets,
                                     max_new_tokens=args.max_new_tokens, tree=TREE)
        if args.save and draft is not target:  # the target drafting for itself is a row to compare, not a pair
            for saved, extra in [(reference, {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens}),
                                 *record_references(target, draft, args)]:
                print("saved", save_reference(saved, extra, folder=REFERENCES), flush=True)
        for k in KS:
            records = run(target, prompts, method="chain", draft=draft, k=k, max_new_tokens=args.max_new_tokens,
                          progress=False)
            produced = {index: tokens for (_, index), tokens in outputs(records).items()}
            draft_rows.append({"draft": spec.label, "quantization": quant, "k": k,
                               "c": profile.forward_s(1, context) / target_profile.forward_s(1, context),
                               "acceptance_rate": records["accepted"].sum() / records["drafted"].sum(),
                               "tokens_per_step": tokens_per_step(records), "tokens_per_s": tokens_per_second(records),
                               "speedup": tokens_per_second(records) / tokens_per_second(baseline),
                               "lossless": produced == expected})
            [predicted] = predict([OperatingPoint("chain", k)], target_profile, profile, reference, context=context,
                                  overhead_s=overhead_s)
            prediction_rows.append({"point": f"{spec.label} chain K={k}", "quantized": quant != "none",
                                    "predicted_tps": predicted["tokens_per_s"], "measured_tps": tokens_per_second(records),
                                    "tps_error": predicted["tokens_per_s"] / tokens_per_second(records) - 1})
        if draft is not target:
            del draft
            gc.collect()

    report(args, memory_rows, draft_rows, prediction_rows, context)


def steady_profile(loaded):
    """The grid measured twice, each point's faster median kept: a transient slowdown of this shared
    box (seen: a 1-token forward at 125 ms in one pass, 69 ms in another) hits one pass, rarely both."""
    first, meta = profile_model(loaded, **GRID)
    second, _ = profile_model(loaded, **GRID)
    rows = tuple((*a[:2], min(a[2], b[2]), *a[3:]) for a, b in zip(first.rows, second.rows))
    return replace(first, rows=rows), dict(meta, passes=2)


def variant_row(loaded, profile, target_profile, records, expected, context: int) -> dict:
    """Memory and target-only speed of one loaded variant; of the target's own weights, its greedy agreement
    with the fp32 target (a quantized target changes the output; a quantized draft must not)."""
    row = {"model": loaded.spec.label, "quantization": loaded.spec.quantization,
           "weight_mib": loaded.weight_bytes / 2**20, "kv_kib_per_token": loaded.kv_bytes_per_token / 1024,
           "forward_ms": 1000 * profile.forward_s(1, context),
           "vs_fp32_target_forward": profile.forward_s(1, context) / target_profile.forward_s(1, context),
           "target_only_tokens_per_s": tokens_per_second(records)}
    if expected is not None:
        produced = {index: tokens for (_, index), tokens in outputs(records).items()}
        same = [sum(1 for _ in _common_prefix(produced[i], expected[i])) / max(1, len(expected[i])) for i in expected]
        row["greedy_prefix_vs_fp32"] = statistics.mean(same)
    return row


def _common_prefix(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def record_references(target, draft, args) -> list:
    """The draft's acceptance reference on each --reference-datasets set (what ships)."""
    out = []
    for dataset in args.reference_datasets:
        texts = [row["prompt"] for row in load_prompts(dataset, limit=args.reference_prompts)]
        reference = record_reference(target, draft, texts, dataset=dataset, max_chain=8,
                                     tree_budgets=args.reference_budgets, max_new_tokens=args.reference_tokens)
        out.append((reference, {"prompts": len(texts), "max_new_tokens": args.reference_tokens}))
    return out


def report(args, memory_rows, draft_rows, prediction_rows, context) -> None:
    pd.set_option("display.width", 220)
    memory = pd.DataFrame(memory_rows)
    drafts = pd.DataFrame(draft_rows)
    predictions = pd.DataFrame(prediction_rows)
    quantized = predictions[predictions["quantized"]]
    median_error = statistics.median(abs(e) for e in quantized["tps_error"]) if len(quantized) else None
    print(f"\n== {args.family}: each variant alone (fp32 compute, {args.prompts} bench prompts x {args.max_new_tokens} "
          f"tokens, forward at context {context}) ==")
    print(memory.round(3).to_string(index=False))
    print(f"\n== as a draft of the fp32 {FAMILIES[args.family]['target']} (chain K={KS}) ==")
    print(drafts.round(3).to_string(index=False))
    print("\n== predicted vs measured tokens/s ==")
    print(predictions.round(3).to_string(index=False))
    if median_error is not None:
        print(f"median |tokens/s error| over {len(quantized)} quantized points = {median_error:.1%} (goal <= 10%)")
    write_report(args.out.replace(".json", f"-{args.family}.json"),
                 {"family": args.family, "settings": vars(args), "context": context, "variants": memory_rows,
                  "drafts": draft_rows, "predictions": prediction_rows, "median_abs_tps_error_quantized": median_error})


if __name__ == "__main__":
    main()
