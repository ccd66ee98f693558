"""Local speculative decoding vs Hugging Face assisted generation, measured side by side in one run.

Prints a table per model pair and writes JSON to results/local_sd.json. Greedy, bf16, CPU by default.
Every method's output is compared with target-only's per prompt; a mismatch gets a teacher-forced
check at the first divergence (`specbench.decode.divergence`) and is reported as a near-tie when the target's
logits of the two tokens there are within NEAR_TIE_SHARE of their range (bf16 multi-token verification can flip
such ties); anything else is a bug. Methods are interleaved: each runs on a prompt before the next prompt starts,
in an order rotated per prompt, so the machine's drift during the run weighs on all of them alike.

    python benchmarks/local_sd.py [--pair qwen|smollm2|both] [--max-new-tokens 64] [--prompts 6]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from specbench.api import encode_prompts
from specbench.decode.divergence import NEAR_TIE_SHARE, divergence
from specbench.decode.loop import Decoding, generate
from specbench.methods import DraftSource, make_drafter
from specbench.decode.target import LocalTarget
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec
from specbench.types import SamplingParams

from common import write_report

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams()
CONFIDENT_K, STOP_BELOW = 20, 0.4  # Hugging Face's assisted generation defaults (num_assistant_tokens, threshold)


class ForwardTimer:
    """Counts forward calls of a module and the seconds spent inside them (hooks, no patching)."""

    def __init__(self, module):
        self.calls, self.seconds, self._start = 0, 0.0, None
        self._handles = [module.register_forward_pre_hook(self._before),
                         module.register_forward_hook(self._after)]

    def _before(self, *_):
        self._start = time.perf_counter()

    def _after(self, *_):
        self.calls += 1
        self.seconds += time.perf_counter() - self._start

    def reset(self):
        self.calls, self.seconds = 0, 0.0

    def remove(self):
        for handle in self._handles:
            handle.remove()


def load_prompts(limit: int) -> list[dict]:
    rows = [json.loads(line) for line in (ROOT / "datasets" / "bench_prompts.jsonl").read_text().splitlines()]
    return rows[:limit]


def run_specbench(target, drafter, prompt_ids, k, max_new_tokens, eos):
    started = time.perf_counter()
    result = generate(target, drafter, prompt_ids, Decoding(k, max_new_tokens, GREEDY))
    wall = time.perf_counter() - started
    accepted = sum(r.accepted for r in result.records)
    drafted = sum(r.drafted for r in result.records)
    return result.output_ids, wall, len(result.records), accepted, drafted


def run_hf(target_model, prompt_ids, max_new_tokens, eos, pad, assistant=None, k=None, lookup=None, stop_below=0.0):
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos), pad_token_id=pad)
    if assistant is not None:
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        # 0: fixed K, specbench's chain; else HF's default algorithm (K=20, 0.4), specbench's chain-confident. HF
        # moves the threshold by an ROC fit when scikit-learn is installed; it is not here, so 0.4 stays
        config.assistant_confidence_threshold = stop_below
        kwargs["assistant_model"] = assistant
    if lookup is not None:
        kwargs["prompt_lookup_num_tokens"] = lookup
    input_ids = torch.tensor([prompt_ids])
    started = time.perf_counter()
    with torch.inference_mode():
        out = target_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - started


def divergence_check(target_model, prompt_ids, reference, produced):
    """The target's logits where the outputs part, teacher-forced (`specbench.decode.divergence`), as a dict."""
    found = divergence(target_model, prompt_ids, reference, produced)
    return None if found is None else asdict(found)


def bench_pair(name, target_spec, draft_spec, prompts, max_new_tokens, ks, self_draft_layers, dtype):
    target_loaded = load_model(target_spec)
    target_model = target_loaded.model
    eos = target_loaded.eos_token_ids
    pad = target_loaded.tokenizer.pad_token_id or eos[0]
    target = LocalTarget(target_loaded)
    draft_loaded = load_model(draft_spec) if draft_spec else None
    encoded = encode_prompts([p["prompt"] for p in prompts], target_loaded.tokenizer)
    target_timer = ForwardTimer(target_model)
    draft_timer = ForwardTimer(draft_loaded.model) if draft_loaded else None

    methods = [("specbench", "target-only", None)]
    methods += [("hf", "target-only", None)]
    if draft_loaded:
        methods += [("hf", f"assisted K={k}", k) for k in ks]
        methods += [("specbench", f"chain K={k}", k) for k in ks]
        # Hugging Face's default assisted generation (up to 20 tokens, ended below 0.4) and specbench's same rule
        methods += [("hf", f"assisted K={CONFIDENT_K} p<{STOP_BELOW}", CONFIDENT_K),
                    ("specbench", f"chain-confident K={CONFIDENT_K} p<{STOP_BELOW}", CONFIDENT_K)]
    methods += [("hf", "prompt-lookup K=4", 4), ("hf", "prompt-lookup K=10", 10)]
    methods += [("specbench", "prompt-lookup K=4", 4), ("specbench", "self-draft K=4", 4),
                ("specbench", "substitute-8bit K=4", 4)]
    drafters, by_method = {}, {}
    for engine, method, k in methods:  # each method's drafter, and a warm-up on the first prompt, discarded
        kind = method.split(" ")[0]
        if engine == "specbench" and kind != "target-only":
            key = {"chain": "chain", "chain-confident": "chain-confident", "prompt-lookup": "prompt-lookup",
                   "self-draft": "self-draft", "substitute-8bit": "substitute"}[kind]
            if key not in drafters:
                drafters[key] = make_drafter(key, DraftSource(target, target_loaded, draft_loaded, dtype,
                                                              self_draft_layers, "8bit", stop_below=STOP_BELOW))
            by_method[method] = drafters[key]
        if engine == "specbench":
            run_specbench(target, by_method.get(method), encoded[0], k or 1, 8, eos)
        else:
            run_hf(target_model, encoded[0], 8, eos, pad,
                   assistant=draft_loaded.model if "assisted" in method else None, k=k,
                   lookup=k if "lookup" in method else None, stop_below=STOP_BELOW if "p<" in method else 0.0)
    rows, outputs = [], {}
    bar = tqdm(total=len(methods) * len(encoded), desc=f"bench {name}")
    for index, ids in enumerate(encoded):  # every method on a prompt before the next prompt, the order rotated
        for engine, method, k in methods[index % len(methods):] + methods[:index % len(methods)]:  # per prompt:
            target_timer.reset()  # the machine's drift then weighs on every method alike
            if draft_timer:
                draft_timer.reset()
            if engine == "specbench":
                out, wall, steps, accepted, drafted = run_specbench(target, by_method.get(method), ids, k or 1,
                                                                    max_new_tokens, eos)
                verify_calls = steps
            else:
                out, wall = run_hf(target_model, ids, max_new_tokens, eos, pad,
                                   assistant=draft_loaded.model if "assisted" in method else None,
                                   k=k, lookup=k if "lookup" in method else None,
                                   stop_below=STOP_BELOW if "p<" in method else 0.0)
                verify_calls = target_timer.calls  # each HF target call verifies and emits >= 1 token
                accepted, drafted = len(out) - verify_calls, None
            target_s = target_timer.seconds
            draft_s = draft_timer.seconds if (draft_timer and ("chain" in method or "assisted" in method)) else 0.0
            draft_model_calls = draft_timer.calls if draft_timer else 0
            outputs[(method, engine, index)] = out
            rows.append({"pair": name, "engine": engine, "method": method, "prompt": index,
                         "set": prompts[index]["set"], "tokens": len(out), "wall_s": wall,
                         "verify_steps": verify_calls, "accepted": accepted, "drafted": drafted,
                         "target_forward_s": target_s, "draft_forward_s": draft_s,
                         "draft_calls": draft_model_calls, "target_calls": target_timer.calls})
            bar.update()
    bar.close()
    target_timer.remove()
    frame = pd.DataFrame(rows)
    checks = []
    for (method, engine, index), out in outputs.items():
        reference = outputs[("target-only", "specbench", index)]
        same = out == reference
        check = None if same else divergence_check(target_model, encoded[index], reference, out)
        checks.append({"method": method, "engine": engine, "prompt": index, "identical": same, "check": check})
    return frame, checks


def summarize(frame: pd.DataFrame, checks) -> pd.DataFrame:
    rows = []
    for (engine, method), group in frame.groupby(["engine", "method"], sort=False):
        tokens, wall = group["tokens"].sum(), group["wall_s"].sum()
        steps = group["verify_steps"].sum()
        # Orchestration: wall time not spent inside the target's or the draft's forward, per verify step.
        overhead = (wall - group["target_forward_s"].sum() - group["draft_forward_s"].sum()) / max(steps, 1)
        if method.split(" ")[0] in ("self-draft", "substitute-8bit"):
            overhead = float("nan")  # their draft forwards are not hooked, so the split would mislead
        method_checks = [c for c in checks if c["method"] == method and c["engine"] == engine]
        rows.append({"engine": engine, "method": method, "tokens": int(tokens), "tokens_per_s": tokens / wall,
                     "tokens_per_step": tokens / steps,
                     "acceptance_rate": (group["accepted"].sum() / group["drafted"].sum()
                                         if group["drafted"].notna().all() and group["drafted"].sum() else None),
                     "overhead_ms_per_step": 1000 * overhead,
                     # the draft model's forwards a step (its prefills included): how deep the chains went
                     "draft_forwards_per_step": (group["draft_calls"].sum() / steps
                                                 if method.split(" ")[0].startswith(("chain", "assisted")) else None),
                     "identical": sum(c["identical"] for c in method_checks),
                     "near_ties": sum(bool(c["check"] and c["check"]["near_tie"]) for c in method_checks),
                     "prompts": len(method_checks)})
    table = pd.DataFrame(rows)
    base = table[(table.engine == "specbench") & (table.method == "target-only")]["tokens_per_s"].iloc[0]
    hf_methods = table[(table.engine == "hf") & (table.method != "target-only")]
    hf_best = hf_methods["tokens_per_s"].max() if len(hf_methods) else float("nan")
    table["vs_target_only"] = table["tokens_per_s"] / base
    table["vs_hf_best"] = table["tokens_per_s"] / hf_best
    return table


def per_set_best(frame: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for prompt_set, group in frame.groupby("set"):
        speeds = group.groupby(["engine", "method"]).apply(lambda g: g["tokens"].sum() / g["wall_s"].sum())
        ours = speeds.loc["specbench"].drop("target-only")
        theirs = speeds.loc["hf"].drop("target-only")
        rows.append({"set": prompt_set, "specbench_best": ours.idxmax(), "specbench_tps": ours.max(),
                     "hf_best": theirs.idxmax(), "hf_tps": theirs.max(), "ratio": ours.max() / theirs.max(),
                     "target_only_tps": speeds.loc[("specbench", "target-only")]})
    return pd.DataFrame(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=["qwen", "smollm2", "both"], default="both")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(ROOT / "results" / "local_sd.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = load_prompts(args.prompts)
    pairs = []
    if args.pair in ("qwen", "both"):
        pairs.append(("qwen", ModelSpec("qwen2.5-coder-1.5b", dtype=args.dtype),
                      ModelSpec("qwen2.5-coder-0.5b", dtype=args.dtype), [2, 4, 6], 20))
    if args.pair in ("smollm2", "both"):
        pairs.append(("smollm2", ModelSpec("smollm2-135m", dtype=args.dtype), None, [], 26))
    report = {"settings": vars(args), "near_tie_share": NEAR_TIE_SHARE, "pairs": {}}
    pd.set_option("display.width", 200)
    for name, target_spec, draft_spec, ks, layers in pairs:
        frame, checks = bench_pair(name, target_spec, draft_spec, prompts, args.max_new_tokens, ks, layers, args.dtype)
        table, best = summarize(frame, checks), per_set_best(frame)
        print(f"\n== {name} ({args.dtype}, greedy, {len(prompts)} prompts x {args.max_new_tokens} tokens) ==")
        print(table.round(3).to_string(index=False))
        print(best.round(3).to_string(index=False))
        for check in checks:
            if not check["identical"]:
                print(f"  mismatch {check['engine']}/{check['method']} prompt {check['prompt']}: {check['check']}")
        report["pairs"][name] = {"summary": table.to_dict("records"), "best_per_set": best.to_dict("records"),
                                 "checks": checks, "per_prompt": frame.to_dict("records")}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
