"""Default vs oneDNN vs tuned linear kernels (`kernels="onednn"`, `"tuned"`), and fp32 vs bf16: whole target
forwards at SD's shapes, side by side, and (`--sd`) whole SD runs on each.

For each model, every variant (`default`: fp32 with PyTorch's kernels, `onednn`: fp32 with oneDNN's
linears, `tuned`: fp32, per layer shape and row count the fastest product form measured at load, `bf16`:
bfloat16 weights and activations, which pays on CPUs with AVX-512 bf16 instructions, `bf16-tuned`: bf16 with
tuned forms, for CPUs whose bf16 one-row product is slow) is loaded and timed
alternately (repeat by repeat, so drift on a shared box hits all alike) on forwards of `batch` sequences x
`tokens` new tokens over a cached context: (1, 1) a target-only step, (1, 2..13) verifies of K=1..4, 7
chains and a 12-node tree, (8, 1) and (8, 5) 8 clients batched on a worker. Besides the speed-up per shape
it prints the ratios that decide SD and batching on a CPU: what a 2-, 3- and 5-token verify costs against
a 1-token step, and what a batch of 8 costs against one sequence. Prints a table and writes
results/cpu_kernels.json.

`--sd`: greedy runs of target-only and n-gram drafts (prompt lookup K=1, 2, 4; suffix) on MT-bench and
HumanEval prompts on each variant, the variants alternated prompt by prompt; tok/s per method and variant,
each method's speed-up over its own variant's target-only, and whether every output equals that
target-only's token for token.

    python benchmarks/cpu_kernels.py [--models smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b] \
        [--variants default onednn tuned bf16 bf16-tuned] [--sd --prompts 6 --max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from specbench.hardware import device_name
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec

from common import write_report

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 1), (1, 2), (1, 3), (1, 5), (1, 8), (1, 13), (8, 1), (8, 5)]
VARIANTS = {"default": dict(dtype="float32"), "onednn": dict(dtype="float32", kernels="onednn"),
            "tuned": dict(dtype="float32", kernels="tuned"), "bf16": dict(dtype="bfloat16"),
            "bf16-tuned": dict(dtype="bfloat16", kernels="tuned")}
SD_METHODS = [("target-only", 1), ("prompt-lookup", 1), ("prompt-lookup", 2), ("prompt-lookup", 4), ("suffix", 16)]


@torch.inference_mode()
def timed_forward(model, cache, new: torch.Tensor) -> float:
    """Milliseconds of one forward of `new` ids over `cache`, which is then cropped back."""
    started = time.perf_counter()
    model(input_ids=new, past_key_values=cache, use_cache=True)
    elapsed = 1000 * (time.perf_counter() - started)
    cache.crop(-new.shape[1])
    return elapsed


def random_cache(model, batch: int, context: int, dtype: torch.dtype):
    """A cache of `context` random positions per sequence: a forward's time depends on shapes only,
    and prefilling 8 x 256 tokens of a 1.5B model on 2 cores would take a minute per shape."""
    from transformers import DynamicCache

    config = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(batch, heads, context, head_dim, dtype=dtype),
                     torch.randn(batch, heads, context, head_dim, dtype=dtype), layer)
    return cache


def sd_runs(name: str, variants: dict, prompts: list[str], max_new_tokens: int) -> pd.DataFrame:
    """One row per (variant, method, K): tok/s over all prompts, its speed-up over the variant's target-only,
    whether every output equals that target-only's, and of those that do not, how many part at a near-tie of
    the variant's own logits (`api.divergences`: rounding of a wider verify in bf16; any other is a defect).
    Variants alternate prompt by prompt."""
    from specbench.api import divergences, outputs, run
    from specbench.decode.target import LocalTarget

    targets = {variant: LocalTarget(loaded) for variant, loaded in variants.items()}
    seconds, tokens, differ, near_ties = {}, {}, {}, {}
    for index, prompt in enumerate(prompts):
        for variant, target in targets.items():
            texts, reference = {}, None
            for method, k in SD_METHODS:
                records = run(target, [prompt], method=method, k=k, max_new_tokens=max_new_tokens, progress=False,
                              warmup=index == 0)
                key = (variant, method, k)
                seconds[key] = seconds.get(key, 0.0) + float(records["step_s"].sum())
                tokens[key] = tokens.get(key, 0) + int(records["emitted"].sum())
                texts[(method, k)] = next(iter(outputs(records).values()))
                if method == "target-only":  # first of SD_METHODS: the outputs the others are checked against
                    reference = records
                unlike = texts[(method, k)] != texts[("target-only", 1)]
                differ[key] = differ.get(key, 0) + unlike
                if unlike:  # outside the timed steps: the target's logits where the two outputs part
                    found = divergences(records, target, [prompt], reference=reference)
                    near_ties[key] = near_ties.get(key, 0) + int(found["near_tie"].sum())
    rows = []
    for (variant, method, k), spent in seconds.items():
        key = (variant, method, k)
        rows.append({"model": name, "variant": variant, "method": method, "k": k, "tok_s": tokens[key] / spent,
                     "same_as_target_only": differ[key] == 0, "outputs_unlike": differ[key],
                     "of_them_near_ties": near_ties.get(key, 0)})
    table = pd.DataFrame(rows)
    alone = table[table.method == "target-only"].set_index("variant")["tok_s"]
    table["over_target_only"] = table.tok_s / table.variant.map(alone)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    parser.add_argument("--variants", nargs="+", default=["default", "onednn"], choices=sorted(VARIANTS),
                        help="the first is the one the others are compared with")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per shape and variant")
    parser.add_argument("--sd", action="store_true", help="also whole SD runs on each variant")
    parser.add_argument("--prompts", type=int, default=6, help="--sd: prompts of each of MT-bench and HumanEval")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "results" / "cpu_kernels.json"))
    args = parser.parse_args()
    rows, first, runs, chosen = [], args.variants[0], [], {}
    for name in args.models:
        variants = {variant: load_model(ModelSpec(name, **VARIANTS[variant])) for variant in args.variants}
        for variant, loaded in variants.items():
            table = getattr(loaded.model, "tuned_kernels", None)  # `use_tuned`'s choice
            if table:
                chosen[f"{name} {variant}"] = {str(shape): forms for shape, forms in table.items()}
                print(f"{name} {variant}: forms chosen per (out, in, bias) and rows: {chosen[f'{name} {variant}']}")
        for batch, tokens in SHAPES:
            new = torch.randint(100, 5000, (batch, tokens), generator=torch.Generator().manual_seed(batch + tokens))
            caches = {variant: random_cache(loaded.model, batch, args.context, loaded.model.dtype)
                      for variant, loaded in variants.items()}
            samples = {variant: [] for variant in variants}
            for attempt in range(args.repeats + 1):  # alternating, one forward each per round; the first a warm-up
                for variant, loaded in variants.items():
                    elapsed = timed_forward(loaded.model, caches[variant], new)
                    if attempt:
                        samples[variant].append(elapsed)
            row = {"model": name, "batch": batch, "tokens": tokens}
            for variant, loaded in variants.items():
                row[f"{variant}_ms"] = statistics.median(samples[variant])
                row[f"weight_mb_{variant}"] = loaded.weight_bytes / 1e6
            for variant in args.variants[1:]:
                row[f"speedup_{variant}"] = row[f"{first}_ms"] / row[f"{variant}_ms"]
            rows.append(row)
            print(rows[-1], flush=True)
        if args.sd:
            from specbench.datasets.loaders import load_prompts

            prompts = [row["prompt"] for dataset in ("mt-bench", "humaneval")
                       for row in load_prompts(dataset, limit=args.prompts)]
            runs.append(sd_runs(name, variants, prompts, args.max_new_tokens))
            print(runs[-1].round(3).to_string(index=False), flush=True)
        del variants
        gc.collect()
    table = pd.DataFrame(rows)
    print(f"\n== forward ms per variant ({', '.join(args.variants)}), context {args.context}, "
          f"{device_name('cpu')}, {torch.get_num_threads()} threads, median of {args.repeats} ==")
    print(table.round(2).to_string(index=False))
    at = table.set_index(["model", "batch", "tokens"])
    ratios = pd.DataFrame([{
        "model": name, **{f"verify{n}_over_step1_{v}": at.loc[(name, 1, n), f"{v}_ms"] / at.loc[(name, 1, 1), f"{v}_ms"]
                          for n in (2, 3, 5) for v in args.variants},
        **{f"batch8_over_one_{v}": at.loc[(name, 8, 1), f"{v}_ms"] / at.loc[(name, 1, 1), f"{v}_ms"]
           for v in args.variants}} for name in args.models])
    print("\n== what SD and batching pay: a 2-, 3-, 5-token verify / a 1-token step; 8 sequences / one ==")
    print(ratios.round(2).T.to_string(header=False))
    report = {"rows": rows, "ratios": ratios.to_dict("records"), "settings": vars(args), "device": device_name("cpu"),
              "tuned_forms": chosen}
    if runs:
        sd = pd.concat(runs, ignore_index=True)
        print(f"\n== greedy SD on each variant: tok/s and speed-up over the same variant's target-only, "
              f"{args.prompts} MT-bench + {args.prompts} HumanEval prompts, {args.max_new_tokens} tokens ==")
        print(sd.round(3).to_string(index=False))
        report["sd"] = sd.to_dict("records")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
