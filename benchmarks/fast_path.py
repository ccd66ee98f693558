"""Eager vs fast (`fast=`: static caches, fixed-shape compiled steps) on this machine, side by side.

Part 1, forwards: a target's verify forward of n = 1, 2, 4, 8 tokens after a `--context`-token prompt,
through `LocalTarget` eager (its default path: the pooled cache) and fast, alternating repeat by repeat
so drift on a shared box hits both alike; the fast path's first call per shape (its compile) is
reported apart. `--hf-step` adds the fast path with Hugging Face's forward as its step in place of
`decode/lean_forward.py` (what the lean step buys), alternated with the others. Part 2, runs: `run()` of target-only and the pair's SD method, eager and fast, on the
same prompts: tokens/s, the fast/eager ratio, and whether every output is identical. Each fast run is
done once untimed first, so every shape it meets is compiled before the timed passes.

    python benchmarks/fast_path.py [--pairs smollm2 qwen] [--backend compile] [--prompts 3] [--methods M ...]
                                   [--dtype bfloat16] [--no-forwards]
"""
from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch

from specbench.api import outputs, run
from specbench.decode.fast_forward import FastForward
from specbench.decode.kv import crop_to
from specbench.decode.target import LocalTarget
from specbench.models.loading import as_loaded

from common import RESULTS, bench_prompts, write_report

PAIRS = {  # target, draft (None: prompt lookup), SD method
    "smollm2": ("smollm2-135m", None, "prompt-lookup"),
    "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "chain"),
}


def forward_ms(target: LocalTarget, n: int, context: int) -> float:
    """One verify-sized forward of `n` tokens after `context` cached ones (then rolled back), in ms."""
    if "bench" not in target.sessions:
        target.prefill("bench", [(7 * i) % 1000 + 100 for i in range(context + 1)])
    state = target.sessions["bench"]
    started = time.perf_counter()
    target.forward(state, [11] * n, None, None)
    elapsed = 1000 * (time.perf_counter() - started)
    crop_to(state.cache, context)
    return elapsed


def forwards(loaded, backend: str, context: int, repeats: int, hf_step: bool = False) -> list[dict]:
    targets = {"eager": LocalTarget(loaded), "fast": LocalTarget(loaded, fast=backend)}
    if hf_step:  # the same fast path, stepping through Hugging Face's forward
        targets["fast_hf"] = LocalTarget(loaded, fast=backend)
        targets["fast_hf"].fast = FastForward(loaded.model, targets["fast"].fast.capacity, backend, lean=False)
    rows = []
    for n in (1, 2, 4, 8):
        first = forward_ms(targets["fast"], n, context)  # compiles this shape
        for name, target in targets.items():
            if name != "fast":
                forward_ms(target, n, context)
        times = {name: [] for name in targets}
        for _ in range(repeats):
            for name, target in targets.items():
                times[name].append(forward_ms(target, n, context))
        ms = {name: statistics.median(samples) for name, samples in times.items()}
        row = {"model": loaded.spec.label, "tokens": n, "context": context, "eager_ms": ms["eager"],
               "fast_ms": ms["fast"], "eager_over_fast": ms["eager"] / ms["fast"], "first_fast_call_s": first / 1000}
        if hf_step:
            row.update(fast_hf_ms=ms["fast_hf"], fast_hf_over_fast=ms["fast_hf"] / ms["fast"])
        rows.append(row)
        print(f"  {loaded.spec.label} n={n}: " + ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items())
              + f" (eager/fast x{ms['eager'] / ms['fast']:.2f}; first call {first / 1000:.1f} s)", flush=True)
    return rows


def runs(pair: str, backend: str, prompts: list[str], max_new_tokens: int, repeats: int,
         sd_methods: list[str] | None = None, dtype: str = "float32") -> list[dict]:
    target_name, draft_name, method = PAIRS[pair]
    loaded = as_loaded(target_name, dtype)
    draft = as_loaded(draft_name, dtype) if draft_name else None
    methods = ["target-only", *(sd_methods or [method])]
    kwargs = dict(draft=draft, k=4, max_new_tokens=max_new_tokens, progress=False)
    fast_target = LocalTarget(loaded, fast=backend)
    started = time.perf_counter()
    run(fast_target, prompts, method=methods, fast=backend, **kwargs)  # compiles every shape it meets
    compile_s = time.perf_counter() - started
    print(f"  {pair}: first fast pass (compiling) {compile_s:.0f} s", flush=True)
    frames = {"eager": [], "fast": []}
    for _ in range(repeats):
        frames["eager"].append(run(LocalTarget(loaded, fast=False), prompts, method=methods, fast=False, **kwargs))
        frames["fast"].append(run(fast_target, prompts, method=methods, fast=backend, **kwargs))
    rows = []
    for name in methods:
        rate = {}
        for variant, done in frames.items():
            tokens_per_s = []
            for frame in done:
                steps = frame[frame.method == name]
                tokens_per_s.append(steps["emitted"].sum() / steps["step_s"].sum())
            rate[variant] = statistics.median(tokens_per_s)
        got_eager, got_fast = outputs(frames["eager"][0]), outputs(frames["fast"][0])
        identical = sum(got_fast[(name, i)] == got_eager[(name, i)] for i in range(len(prompts)))
        rows.append({"pair": pair, "dtype": dtype, "method": name, "eager_tok_s": rate["eager"], "fast_tok_s": rate["fast"],
                     "fast_over_eager": rate["fast"] / rate["eager"], "identical": f"{identical}/{len(prompts)}",
                     "first_fast_pass_s": compile_s})
        print(f"  {pair} {name}: eager {rate['eager']:.2f} tok/s, fast {rate['fast']:.2f} tok/s "
              f"(x{rate['fast'] / rate['eager']:.2f}), identical {identical}/{len(prompts)}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--backend", default="compile", choices=["compile", "static", "cudagraph"])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--dtype", default="float32", help="target and draft (bfloat16 pays on CPUs with avx512_bf16)")
    parser.add_argument("--no-forwards", action="store_true", help="only part 2 (the runs)")
    parser.add_argument("--no-runs", action="store_true", help="only part 1 (the forwards)")
    parser.add_argument("--hf-step", action="store_true", help="part 1 also times the fast path with Hugging Face's "
                                                               "forward as its step (lean_forward off)")
    parser.add_argument("--repeats", type=int, default=5, help="forward timings per shape and variant")
    parser.add_argument("--run-repeats", type=int, default=2, help="timed runs per variant")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--methods", nargs="+", help="SD methods beside target-only (default: the pair's), e.g. "
                                                     "chain tree for qwen, prompt-lookup self-draft for smollm2")
    parser.add_argument("--out", default=str(RESULTS / "fast_path.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = bench_prompts(args.prompts)
    forward_rows, run_rows = [], []
    for pair in args.pairs:
        target_name, draft_name, _ = PAIRS[pair]
        for name in filter(None, (target_name, draft_name)):
            if not args.no_forwards:
                print(f"{pair}: forwards of {name}", flush=True)
                forward_rows += forwards(as_loaded(name, args.dtype), args.backend, args.context, args.repeats,
                                         args.hf_step)
        if not args.no_runs:
            print(f"{pair}: runs ({args.dtype})", flush=True)
            run_rows += runs(pair, args.backend, prompts, args.max_new_tokens, args.run_repeats, args.methods,
                             args.dtype)
        report = {"backend": args.backend, "forwards": forward_rows, "runs": run_rows, "args": vars(args)}
        write_report(args.out, report)  # after each pair: a long run that dies keeps what it measured
    pd.set_option("display.width", 200)
    if forward_rows:
        print(pd.DataFrame(forward_rows).round(3).to_string(index=False))
    if run_rows:
        print(pd.DataFrame(run_rows).round(3).to_string(index=False))


if __name__ == "__main__":
    main()
