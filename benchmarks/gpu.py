"""The GPU path measured: eager vs fast forwards of real architectures, their memory floor, the draft/target
cost ratio, and the SD loop's step cost replaying a shipped acceptance trace.

Weights are random (a forward's time depends on shapes, not values), so nothing is downloaded on the GPU
machine: the Qwen2.5 0.5B / 1.5B / 7B configurations are written out below. For each architecture:
forward latency over tokens x contexts, eager (Hugging Face's dynamic cache) and fast
(`decode/fast_forward.py`: static cache, graph-captured on CUDA, compiled on a CPU); the memory floor
(weight bytes + the context's KV bytes, over the device's copy bandwidth measured here); then per
(draft, target) pair the cost ratio c = draft step / target step, and a replay of the reference's
accepted lengths per step (draft K one-token steps, one K+1-token verify with its greedy argmax read
back, caches rolled back to what was accepted) against target-only steps, eager and fast. Last, a prompt's
forward (its last row of logits) of `--prompts` tokens, eager and fast (chunks replayed at prefill buckets),
and the fast step through `decode/lean_forward.py` (the default) against Hugging Face's forward as the step.

    python benchmarks/gpu.py                            # on CUDA: 0.5B, 1.5B, 7B in bf16
    python benchmarks/gpu.py --save-profiles            # also write profiles/ for notebook 03
    python benchmarks/gpu.py --device cpu --archs tiny --dtype float32 --backend static   # a check of the script
    python benchmarks/gpu.py --archs qwen2.5-1.5b --kernels    # also the lean step's kernels, per layer
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

import pandas as pd
import torch

from specbench.decode.clock import device_time
from specbench.decode.fast_forward import FastForward
from specbench.decode.kv import crop_to, new_cache
from specbench.decode.profile import forward_latency_grid
from specbench.decode.static_kv import rounded
from specbench.hardware import device_name
from specbench.models.memory import kv_bytes_per_token, weight_bytes

from common import RESULTS, write_report

# Public Qwen2.5 configurations (the Coder models share them); "tiny" checks the script on a CPU.
ARCHS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "tiny-draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True),
}
PROFILE_LABELS = {"qwen2.5-0.5b": "qwen2.5-coder-0.5b", "qwen2.5-1.5b": "qwen2.5-coder-1.5b",
                  "qwen2.5-7b": "qwen2.5-coder-7b"}  # the catalog names the shipped references use
PAIRS = [("qwen2.5-0.5b", "qwen2.5-1.5b"), ("qwen2.5-0.5b", "qwen2.5-7b"), ("qwen2.5-1.5b", "qwen2.5-7b"),
         ("tiny-draft", "tiny")]


def build(arch: str, dtype: torch.dtype, device: str):
    """The architecture with random weights, made directly on the device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**ARCHS[arch], max_position_embeddings=32768, rope_theta=1e6,
                         attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    return model


def bandwidth(device: str, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), best of five."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = device_time(device)
        target.copy_(source)
        best = min(best, device_time(device) - start)
    return 2 * source.numel() / best


def floor_s(model, tokens: int, context: int, bytes_per_s: float, batch: int = 1) -> float:
    """The least time a forward can take: every weight and each row's context keys and values read once."""
    return (weight_bytes(model) + batch * kv_bytes_per_token(model) * (context + tokens)) / bytes_per_s


class Stepper:
    """One model's forwards of n tokens on one cache, eager (`forward` None) or fast, rolled back by length."""

    def __init__(self, model, forward: FastForward | None):
        self.model, self.device, self.forward = model, model.get_input_embeddings().weight.device, forward
        self.cache = forward.new_cache() if forward else new_cache(model.config)
        self.length = 0

    @torch.inference_mode()
    def step(self, n: int, read_back: bool = False):
        ids = [(self.length * 7 + i) % 500 + 10 for i in range(n)]
        if self.forward is not None:
            logits = self.forward(self.cache, ids)
        else:
            input_ids = torch.tensor([ids], device=self.device)
            logits = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True).logits[0]
        self.length += n
        return logits.argmax(-1).tolist() if read_back else None

    def roll_back(self, length: int) -> None:
        if self.forward is not None:
            self.cache.set_length(length)
        else:
            crop_to(self.cache, length)
        self.length = length


def replay(drafter: Stepper, verifier: Stepper, accepts: list[int], k: int, context: int) -> float:
    """Seconds of SD replaying `accepts` (min(a, k) per step) after a `context`-token prompt; tokens emitted."""
    for stepper in (drafter, verifier):
        stepper.roll_back(0)
        stepper.step(context)
    committed, emitted = context + 1, 0  # the target caches all but the last committed token (its tail)
    start = device_time(verifier.device)
    for accepted in (min(a, k) for a in accepts):
        # as ModelDrafter: keep the common prefix (the accepted drafts), feed the rest (the bonus, at least)
        keep = min(drafter.length, committed - 1)
        drafter.roll_back(keep)
        drafter.step(committed - keep, read_back=True)  # each draft token is read before the next step
        for _ in range(k - 1):
            drafter.step(1, read_back=True)
        verifier.step(k + 1, read_back=True)  # tail + K drafts; the greedy choices leave the device
        verifier.roll_back(committed + accepted)
        committed += accepted + 1
        emitted += accepted + 1
    return device_time(verifier.device) - start, emitted


def target_only(stepper: Stepper, tokens: int, context: int) -> float:
    stepper.roll_back(0)
    stepper.step(context)
    start = device_time(stepper.device)
    for _ in range(tokens):
        stepper.step(1, read_back=True)
    return device_time(stepper.device) - start


def measure_pair(draft, target, accepts: list[int], k: int, context: int, repeats: int) -> dict:
    """c (draft step over target step, 1 token at `context`) and SD vs target-only seconds per token, each
    run once to compile or capture every shape before the timed pass (same caches, so graphs are reused)."""
    drafter, verifier, alone = Stepper(*draft), Stepper(*target), Stepper(*target)
    cost = []
    for stepper in (drafter, verifier):
        stepper.roll_back(0)
        stepper.step(context)
        samples = []
        for _ in range(repeats + 2):
            start = device_time(stepper.device)
            stepper.step(1, read_back=True)
            samples.append(device_time(stepper.device) - start)
            stepper.roll_back(context)
        cost.append(statistics.median(samples[2:]))
    replay(drafter, verifier, accepts, k, context)  # warm-up
    sd_s, emitted = replay(drafter, verifier, accepts, k, context)
    target_only(alone, emitted, context)  # warm-up
    alone_s = target_only(alone, emitted, context)
    return {"c": cost[0] / cost[1], "draft_step_ms": 1000 * cost[0], "target_step_ms": 1000 * cost[1],
            "sd_ms_per_token": 1000 * sd_s / emitted, "target_only_ms_per_token": 1000 * alone_s / emitted,
            "speedup": alone_s / sd_s, "mean_accepted": emitted / len(accepts) - 1}


def reference_accepts(steps: int) -> tuple[list[int], str]:
    """Accepted lengths per step from the shipped Qwen2.5-Coder 0.5B -> 1.5B reference (mt-bench)."""
    from specbench.plan.library import load_references

    found = load_references(draft="qwen2.5-coder-0.5b", target="qwen2.5-coder-1.5b", dataset="mt-bench",
                            rule="greedy")
    if not found:
        return [2, 0, 4, 1, 3] * (steps // 5 + 1), "a fixed trace (no shipped reference found)"
    accepts = list(found[0].chain_accepts)
    return (accepts * (steps // len(accepts) + 1))[:steps], f"reference {found[0].draft}->{found[0].target} mt-bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--archs", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"],
                        choices=list(ARCHS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default=None, choices=["compile", "cudagraph", "compiled-graph", "static"],
                        help="the fast path's backend (default: cudagraph on CUDA, compile on a CPU)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8],
                        help="rows of a batched verify (a worker shared by that many clients), beside one row")
    parser.add_argument("--batch-tokens", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    parser.add_argument("--batch-contexts", type=int, nargs="+", default=[512])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--k", type=int, default=4, help="chain length of the SD replay")
    parser.add_argument("--steps", type=int, default=40, help="SD steps replayed per pair")
    parser.add_argument("--step-tokens", type=int, nargs="+", default=[1, 4, 5, 8],
                        help="lone fast steps timed lean and with Hugging Face's forward (at --batch-contexts[0])")
    parser.add_argument("--lean-only", action="store_true",
                        help="time only the lean step in --step-tokens (each variant compiles its own graphs on a "
                             "compiled backend)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[100, 512, 2048],
                        help="prompt lengths whose prefill is timed, eager and fast")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the copy that measures bandwidth")
    parser.add_argument("--save-profiles", action="store_true", help="write eager and fast profiles to profiles/")
    parser.add_argument("--profiles-dir", default=None, help="where --save-profiles writes (default: profiles/)")
    parser.add_argument("--no-pairs", action="store_true", help="skip the SD replays of the draft/target pairs")
    parser.add_argument("--sdpa", nargs="*", default=[], choices=["math", "efficient_attention", "flash_attention",
                                                                  "cudnn_attention"],
                        help="also time the lean step with attention held to each of these kernels")
    parser.add_argument("--kernels", action="store_true",
                        help="list the lean step's device kernels (torch.profiler): time and count per forward")
    parser.add_argument("--out", default=str(RESULTS / "gpu.json"))
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu --archs tiny to check the script")
    dtype = getattr(torch, args.dtype)
    fast = args.backend or ("cudagraph" if args.device.startswith("cuda") else "compile")
    bytes_per_s = bandwidth(args.device, args.bandwidth_mib)
    print(f"{device_name(args.device)}: copy bandwidth {bytes_per_s / 1e9:.0f} GB/s; fast backend {fast}", flush=True)
    capacity = max(args.contexts + args.batch_contexts) + max(args.tokens + args.batch_tokens) + 64
    models, forward_rows, profiles = {}, [], []
    for arch in args.archs:
        model = models[arch] = build(arch, dtype, args.device)
        grids = {variant: grid(model, args, None if variant == "eager" else fast) for variant in ("eager", "fast")}
        for eager, quick in zip(grids["eager"], grids["fast"]):
            floor = floor_s(model, eager["tokens"], eager["context"], bytes_per_s, eager["batch"])
            forward_rows.append({"arch": arch, "batch": eager["batch"], "tokens": eager["tokens"],
                                 "context": eager["context"],
                                 "eager_ms": 1000 * eager["median_s"], "fast_ms": 1000 * quick["median_s"],
                                 "eager_over_fast": eager["median_s"] / quick["median_s"],
                                 "floor_ms": 1000 * floor, "fast_over_floor": quick["median_s"] / floor})
        profiles += [(arch, variant, rows) for variant, rows in grids.items()]
        print(pd.DataFrame([r for r in forward_rows if r["arch"] == arch]).round(3).to_string(index=False), flush=True)
    accepts, trace = reference_accepts(args.steps)
    pair_rows = []
    fast_forwards = {arch: FastForward(model, capacity, fast) for arch, model in models.items()}
    for draft_arch, target_arch in PAIRS:
        if args.no_pairs or draft_arch not in models or target_arch not in models:
            continue
        for variant in ("eager", "fast"):
            chosen = (lambda arch: (models[arch], None if variant == "eager" else fast_forwards[arch]))
            measured = measure_pair(chosen(draft_arch), chosen(target_arch), accepts, args.k, min(args.contexts),
                                    args.repeats)
            pair_rows.append({"draft": draft_arch, "target": target_arch, "forward": variant, "k": args.k,
                              **measured})
    pairs = pd.DataFrame(pair_rows)
    if len(pairs):
        print(f"\nSD replay ({trace}, K={args.k}, context {min(args.contexts)}):")
        print(pairs.round(4).to_string(index=False))
    steps = [row for arch, model in models.items() for row in step_rows(model, arch, args, fast, bytes_per_s)]
    if steps:
        print("\nfast steps, lean forward vs Hugging Face's forward as the step:")
        print(pd.DataFrame(steps).round(3).to_string(index=False))
    prefills = [row for arch, model in models.items() for row in prefill_rows(model, arch, args, fast)]
    if prefills:
        print("\nprefill (a prompt's forward, its last row of logits):")
        print(pd.DataFrame(prefills).round(3).to_string(index=False))
    kernels = [row for arch, model in models.items() for row in kernel_rows(model, arch, args)] if args.kernels else []
    if kernels:
        print("\nthe lean step's device kernels (static backend: the kernels a captured graph replays), per forward:")
        print(pd.DataFrame(kernels).round(4).to_string(index=False))
    report = {"device": device_name(args.device), "dtype": args.dtype, "backend": fast,
              "bandwidth_bytes_per_s": bytes_per_s, "trace": trace, "forwards": forward_rows, "pairs": pair_rows,
              "steps": steps, "prefills": prefills, "kernels": kernels, "args": vars(args)}
    write_report(args.out, report)
    if args.save_profiles:
        save(profiles, models, args, fast)


def grid(model, args, fast) -> list[dict]:
    """One row's tokens x contexts grid, then the batched rows' smaller one (what a shared worker pays)."""
    rows = forward_latency_grid(model, args.tokens, args.contexts, args.repeats, fast=fast)
    batches = [b for b in args.batches if b > 1]
    if batches:
        rows += forward_latency_grid(model, args.batch_tokens, args.batch_contexts, args.repeats, batches=batches,
                                     fast=fast)
    return rows


def step_rows(model, arch: str, args, fast: str, bytes_per_s: float) -> list[dict]:
    """Median ms of a lone fast step of n tokens after `--batch-contexts[0]` cached ones: the lean forward
    (the fast path's step where it supports the model) and Hugging Face's, alternated repeat by repeat; with
    `--sdpa`, also the lean step with attention held to each named kernel (`torch.nn.attention.sdpa_kernel`,
    in force while the graph is captured), to see which one a short query against a long cache wants."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    context = args.batch_contexts[0]
    variants = {"lean": (True, None)} if args.lean_only else {"lean": (True, None), "hf_step": (False, None)}
    variants.update({f"lean_{name}": (True, getattr(SDPBackend, name.upper())) for name in args.sdpa})
    forwards = {variant: FastForward(model, rounded(context + 64), fast, lean=lean)
                for variant, (lean, _) in variants.items()}
    if forwards["lean"].lean is None:
        return []  # an architecture the lean forward does not take: both would be Hugging Face's

    def held(variant):
        kernel = variants[variant][1]
        return sdpa_kernel([kernel]) if kernel is not None else contextlib.nullcontext()

    caches = {variant: forward.new_cache() for variant, forward in forwards.items()}
    prompt = [(i * 7) % 500 + 10 for i in range(context)]
    for variant, forward in forwards.items():
        forward(caches[variant], prompt, logits_to_keep=1)
    device, rows, failed = forwards["lean"].device, [], {}
    for n in args.step_tokens:
        samples = {variant: [] for variant in forwards}
        for attempt in range(args.repeats + 1):  # the first captures (or compiles) the shape
            for variant, forward in forwards.items():
                if variant in failed:
                    continue
                try:
                    with held(variant):
                        start = device_time(device)
                        forward(caches[variant], prompt[:n])
                        seconds = device_time(device) - start
                except RuntimeError as error:  # a kernel that cannot take this shape or mask: said, not fatal
                    failed[variant] = str(error).splitlines()[0][:120]
                    continue
                if attempt:
                    samples[variant].append(seconds)
                caches[variant].set_length(context)
        median = {variant: statistics.median(times) for variant, times in samples.items() if times}
        floor = floor_s(model, n, context, bytes_per_s)
        hf = median.get("hf_step")
        row = {"arch": arch, "tokens": n, "context": context, "backend": fast, "lean_ms": 1000 * median["lean"],
               "hf_step_ms": None if hf is None else 1000 * hf,
               "hf_over_lean": None if hf is None else hf / median["lean"],
               "floor_ms": 1000 * floor, "lean_over_floor": median["lean"] / floor}
        row.update({f"{variant}_ms": 1000 * median[variant] for variant in median if variant.startswith("lean_")})
        rows.append(row)
    for variant, error in failed.items():
        print(f"{variant}: {error}")
    return rows


@torch.inference_mode()
def prefill_rows(model, arch: str, args, fast: str) -> list[dict]:
    """Median ms of a prompt's forward into a fresh cache (the head on its last row only): eager, one Hugging
    Face forward; fast, `FastForward` (chunks of at most 256 tokens replayed at prefill buckets where the
    backend replays shapes; compiled backends run the prompt eagerly on the static cache)."""
    device = model.get_input_embeddings().weight.device
    forward = FastForward(model, rounded(max(args.prompts)), fast)
    rows = []
    for length in args.prompts:
        ids = torch.tensor([[(i * 7) % 500 + 10 for i in range(length)]])
        median, chunks = {}, forward.stats["prefill"]
        for variant in ("eager", "fast"):
            samples = []
            for _ in range(args.repeats + 1):  # the first captures (or compiles) the shapes
                cache = forward.new_cache() if variant == "fast" else new_cache(model.config)
                start = device_time(device)
                if variant == "fast":
                    forward(cache, ids[0].tolist(), logits_to_keep=1)
                else:
                    model(input_ids=ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
                samples.append(device_time(device) - start)
                if variant == "fast":
                    forward.forget(cache)
            median[variant] = statistics.median(samples[1:])
        rows.append({"arch": arch, "prompt": length, "eager_ms": 1000 * median["eager"],
                     "fast_ms": 1000 * median["fast"], "eager_over_fast": median["eager"] / median["fast"],
                     "chunks_replayed": (forward.stats["prefill"] - chunks) // (args.repeats + 1)})
    return rows


@torch.inference_mode()
def kernel_rows(model, arch: str, args, top: int = 12) -> list[dict]:
    """The lean step's device kernels for `--step-tokens`' largest n after `--batch-contexts[0]` tokens,
    grouped by name: count and microseconds per forward, per layer, and share of the kernels' time. Run on
    the `static` backend (the same kernels a captured graph replays, each launched on its own), so the
    sum of kernel time is what a graph replay cannot go below. Empty where no device kernels are seen."""
    context, n, forwards = args.batch_contexts[0], max(args.step_tokens), 5
    forward = FastForward(model, rounded(context + 64), "static")
    cache, prompt = forward.new_cache(), [(i * 7) % 500 + 10 for i in range(context)]
    forward(cache, prompt, logits_to_keep=1)
    for _ in range(3):
        forward(cache, prompt[:n])
        cache.set_length(context)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if str(forward.device).startswith("cuda") else [])
    with torch.profiler.profile(activities=activities) as trace:
        for _ in range(forwards):
            forward(cache, prompt[:n])
            cache.set_length(context)
        if str(forward.device).startswith("cuda"):
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    total = sum(sum(times) for times in kernels.values()) or 1.0
    layers = model.config.num_hidden_layers
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))
    rows = [{"arch": arch, "tokens": n, "context": context, "kernel": name[:80], "per_forward": len(times) / forwards,
             "per_layer": len(times) / forwards / layers, "us_per_forward": sum(times) / forwards,
             "share": sum(times) / total} for name, times in ranked[:top]]
    if kernels:
        rows.append({"arch": arch, "tokens": n, "context": context, "kernel": "(all kernels)",
                     "per_forward": sum(len(t) for t in kernels.values()) / forwards,
                     "per_layer": sum(len(t) for t in kernels.values()) / forwards / layers,
                     "us_per_forward": total / forwards, "share": 1.0})
    return rows


def save(profiles, models, args, fast: str) -> None:
    """Each architecture's eager and fast grid as a LatencyProfile, under the catalog name it stands for."""
    from specbench.plan.library import PROFILES, save_profile  # the shipped profiles: curated here
    from specbench.plan.predict import LatencyProfile

    for arch, variant, rows in profiles:
        model = models[arch]
        profile = LatencyProfile(
            model=PROFILE_LABELS.get(arch, arch), device=device_name(args.device), dtype=args.dtype,
            weight_bytes=weight_bytes(model), kv_bytes_per_token=kv_bytes_per_token(model),
            forward="eager" if variant == "eager" else f"fast-{fast}",
            rows=tuple((r["tokens"], r["context"], r["median_s"], r["batch"]) for r in rows))
        path = save_profile(profile, {"weights": f"random {arch} architecture (latency depends on shapes)",
                                      "repeats": args.repeats,
                                      "step": "lean" if variant != "eager" else "Hugging Face's forward"},
                            folder=args.profiles_dir or PROFILES)
        print(f"profile -> {path}")


if __name__ == "__main__":
    main()
