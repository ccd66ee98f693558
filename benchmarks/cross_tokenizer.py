"""A draft from another family: specbench's cross-tokenizer chain vs Hugging Face's, side by side.

Same prompts, same run, per dtype: target-only (specbench and HF), HF assisted generation with
`assistant_tokenizer` (its cross-tokenizer path) at K = 2, 4, 6 and its default schedule,
specbench's cross-tokenizer chain (text rule) at K = 2, 4, 6 and dynamic trees of 8 and 16 nodes,
and the same-family draft's chain for comparison. Greedy. Reports tokens/s, tokens per target step, target tokens per draft token,
and whether each output is identical to target-only (a mismatch is checked teacher-forced and
shown as a near-tie when the target's top-2 logits there are within NEAR_TIE_LOGITS).

    python benchmarks/cross_tokenizer.py [--dtypes float32 bfloat16] [--ks 2 4 6] [--tree-budgets 8 16]
                                         [--prompts 3] [--max-new-tokens 48] [--kernels default|onednn]
"""
from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
from tqdm.auto import tqdm

from specbench.api import encode_prompts
from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.methods import DraftSource, make_drafter
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec
from specbench.types import SamplingParams

from common import RESULTS, bench_prompts, write_report
from local_sd import NEAR_TIE_LOGITS, ForwardTimer, divergence_check

GREEDY = SamplingParams()


def hf_generate(target, ids, max_new_tokens, assistant=None, k=None):
    """HF generate, greedy; with an assistant of another tokenizer, its cross-tokenizer path."""
    eos = list(target.eos_token_ids)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                  pad_token_id=target.tokenizer.pad_token_id or eos[0])
    if assistant is not None:
        config = assistant.model.generation_config
        if k is None:  # HF's defaults (read from a fresh GenerationConfig)
            from transformers import GenerationConfig

            defaults = GenerationConfig()
            config.num_assistant_tokens = defaults.num_assistant_tokens
            config.num_assistant_tokens_schedule = defaults.num_assistant_tokens_schedule
            config.assistant_confidence_threshold = defaults.assistant_confidence_threshold
        else:  # fixed K, the algorithm specbench's chain runs
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
            config.assistant_confidence_threshold = 0.0
        kwargs.update(assistant_model=assistant.model, tokenizer=target.tokenizer,
                      assistant_tokenizer=assistant.tokenizer)
    input_ids = torch.tensor([ids])
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - started


def specbench_generate(local, drafter, ids, k, max_new_tokens):
    started = time.perf_counter()
    result = generate(local, drafter, ids, Decoding(k, max_new_tokens, GREEDY))
    wall = time.perf_counter() - started
    drafting = [r for r in result.records if r.drafted]
    return result.output_ids, wall, {
        "steps": len(result.records), "accepted": sum(r.accepted for r in result.records),
        "drafted": sum(r.drafted for r in drafting),
        "draft_tokens": sum((r.draft_tokens if r.draft_tokens is not None else r.drafted) for r in drafting)}


def bench_dtype(dtype, target_name, cross_name, family_name, prompts, max_new_tokens, ks, tree_budgets=(),
                kernels="default"):
    kernels = kernels if dtype == "float32" else "default"  # oneDNN layers are float32 only
    target = load_model(ModelSpec(target_name, dtype=dtype, kernels=kernels))
    cross = load_model(ModelSpec(cross_name, dtype=dtype, kernels=kernels))
    family = load_model(ModelSpec(family_name, dtype=dtype, kernels=kernels)) if family_name else None
    local = LocalTarget(target)
    encoded = encode_prompts(prompts, target.tokenizer)
    timer = ForwardTimer(target.model)
    cross_chain = make_drafter("chain", DraftSource(local, target, cross, dtype, cross_tokenizer="text"))
    family_chain = make_drafter("chain", DraftSource(local, target, family, dtype)) if family else None
    methods = [("specbench", "target-only", None, None), ("hf", "target-only", None, None)]
    methods += [("hf", f"assisted-cross K={k}", cross, k) for k in ks] + [("hf", "assisted-cross default", cross, None)]
    methods += [("specbench", f"cross-chain K={k}", cross_chain, k) for k in ks]
    if tree_budgets:  # dynamic trees, each root-to-leaf path re-tokenized, merged into one target trie
        cross_tree = make_drafter("tree", DraftSource(local, target, cross, dtype, cross_tokenizer="text"))
        methods += [("specbench", f"cross-tree {budget}", cross_tree, budget) for budget in tree_budgets]
    if family_chain:
        methods += [("specbench", f"{family_name} chain K=4", family_chain, 4)]
    rows, outputs = [], {}
    bar = tqdm(total=len(methods) * len(encoded), desc=f"cross-tokenizer {dtype}")
    for engine, method, helper, k in methods:
        call = ((lambda ids, n: hf_generate(target, ids, n, helper, k)) if engine == "hf" else
                (lambda ids, n: specbench_generate(local, helper, ids, k or 1, n)[:2]))
        call(encoded[0], 8)  # warm-up, discarded
        for index, ids in enumerate(encoded):
            timer.reset()
            if engine == "hf":
                out, wall = hf_generate(target, ids, max_new_tokens, helper, k)
                stats = {"steps": timer.calls, "accepted": len(out) - timer.calls, "drafted": None, "draft_tokens": None}
            else:
                out, wall, stats = specbench_generate(local, helper, ids, k or 1, max_new_tokens)
            outputs[(engine, method, index)] = out
            rows.append({"dtype": dtype, "engine": engine, "method": method, "prompt": index, "tokens": len(out),
                         "wall_s": wall, **stats})
            bar.update()
    bar.close()
    timer.remove()
    checks = []
    for (engine, method, index), out in outputs.items():
        reference = outputs[("specbench", "target-only", index)]
        same = out == reference
        checks.append({"dtype": dtype, "engine": engine, "method": method, "prompt": index, "identical": same,
                       "check": None if same else divergence_check(target.model, encoded[index], reference, out)})
    return pd.DataFrame(rows), checks


def summarize(frame: pd.DataFrame, checks) -> pd.DataFrame:
    rows = []
    for (engine, method), group in frame.groupby(["engine", "method"], sort=False):
        mine = [c for c in checks if c["engine"] == engine and c["method"] == method]
        drafted = group["drafted"].sum() if group["drafted"].notna().all() else None
        rows.append({"engine": engine, "method": method, "tokens_per_s": group["tokens"].sum() / group["wall_s"].sum(),
                     "tokens_per_step": group["tokens"].sum() / group["steps"].sum(),
                     "acceptance_rate": group["accepted"].sum() / drafted if drafted else None,
                     "target_per_draft_token": drafted / group["draft_tokens"].sum() if drafted else None,
                     "identical": sum(c["identical"] for c in mine),
                     "near_ties": sum(bool(c["check"] and c["check"]["near_tie"]) for c in mine),
                     "prompts": len(mine)})
    table = pd.DataFrame(rows)
    base = table[(table.engine == "specbench") & (table.method == "target-only")]["tokens_per_s"].iloc[0]
    hf_cross = table[table.method.str.startswith("assisted-cross")]["tokens_per_s"].max()
    table["vs_target_only"] = table["tokens_per_s"] / base
    table["vs_hf_cross_best"] = table["tokens_per_s"] / hf_cross
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="smollm2-135m", help="a draft with another tokenizer")
    parser.add_argument("--family-draft", default="qwen2.5-coder-0.5b", help="same-family draft ('' to skip)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 4, 6])
    parser.add_argument("--tree-budgets", nargs="*", type=int, default=[8, 16],
                        help="node budgets of cross-tokenizer dynamic trees (none: chains only)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--kernels", default="default", choices=["default", "onednn"],
                        help="linear kernels of every model (float32 runs; HF's generate uses the same models)")
    parser.add_argument("--out", default=str(RESULTS / "cross_tokenizer.json"))
    args = parser.parse_args()
    prompts = bench_prompts(args.prompts)
    pd.set_option("display.width", 200)
    report = {"settings": vars(args), "near_tie_logits": NEAR_TIE_LOGITS, "dtypes": {}}
    for dtype in args.dtypes:
        frame, checks = bench_dtype(dtype, args.target, args.draft, args.family_draft, prompts,
                                    args.max_new_tokens, args.ks, args.tree_budgets, args.kernels)
        table = summarize(frame, checks)
        print(f"\n== {args.draft} drafting for {args.target} ({dtype}, kernels {args.kernels}, greedy, {len(prompts)} prompts x "
              f"{args.max_new_tokens} tokens) ==")
        print(table.round(3).to_string(index=False))
        ours = table[table.method.str.startswith("cross-")]["tokens_per_s"].max()
        print(f"goals: specbench best cross / HF best cross = {ours / table[table.method.str.startswith('assisted-cross')]['tokens_per_s'].max():.2f} "
              f"(>= 1.0), / target-only = {ours / table['tokens_per_s'].iloc[0]:.2f} (>= 1.25)")
        for check in checks:
            if not check["identical"]:
                print(f"  mismatch {check['engine']}/{check['method']} prompt {check['prompt']}: {check['check']}")
        report["dtypes"][dtype] = {"summary": table.to_dict("records"), "checks": checks,
                                   "per_prompt": frame.to_dict("records")}
        write_report(args.out, report)  # after each dtype, so a cut-short run keeps what it measured


if __name__ == "__main__":
    main()
