"""A worker on the GPU under load: aggregate tokens/s of 1..8 clients against eager and fast workers,
batched and not, each a real `specbench worker --device cuda` on loopback.

Weights are random (a step's time depends on shapes, not values): the architecture is written to a
local model directory with a word-level tokenizer made here, and the worker loads it like any other
path. Clients are processes decoding target-only (prompts of random ids), starting together after a
warm-up round that lets the fast worker capture its batch shapes; each decodes `--rounds` prompts of
`--max-new-tokens` tokens. What it shows: how much of a fast step the worker's own per-step work (the
loopback round trip, Python, the host side of a batch) leaves, and what batching buys on a GPU.

    python benchmarks/gpu_worker.py                       # on CUDA: qwen2.5-1.5b in bf16
    python benchmarks/gpu_worker.py --breakdown           # one client: a step's parts, local and through each worker
    python benchmarks/gpu_worker.py --chain               # chain SD under load, measured vs predicted
    python benchmarks/gpu_worker.py --device cpu --arch tiny --dtype float32 --workers eager fast-static
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import tempfile
import time

import pandas as pd
import torch

from specbench.hardware import device_name
from specbench.worker.launch import free_port, spawn_worker

from common import RESULTS, write_report
from gpu import ARCHS, build

WORKERS = {"eager": ["--fast", "off"], "eager-unbatched": ["--fast", "off", "--no-batching"],
           "fast": ["--fast", "auto"], "fast-unbatched": ["--fast", "auto", "--no-batching"],
           "fast-static": ["--fast", "static"]}


def save_model(arch: str, dtype: torch.dtype, folder: str) -> None:
    """The architecture with random weights and a small byte-level BPE (the kind Qwen2's tokenizer class
    reads), as a directory `load_model` reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = build(arch, dtype, "cpu")
    model.generation_config.eos_token_id = None  # random weights: decode every token asked for
    model.save_pretrained(folder)
    words = Tokenizer(models.BPE())
    words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words.decoder = decoders.ByteLevel()
    corpus = [f"w{i} " * 3 for i in range(512)] + ["the quick brown fox jumps over the lazy dog"] * 8
    words.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<|endoftext|>").save_pretrained(folder)


@contextlib.contextmanager
def serving(folder: str, kind: str, args):
    """A `specbench worker` of `kind` serving the model directory on loopback: its endpoint, stopped after."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(endpoint, "--model", folder, "--device", args.device, "--dtype", args.dtype,
                          *WORKERS[kind], timeout_s=600)
    try:
        yield endpoint
    finally:
        worker.terminate()
        worker.wait(30)


def client(endpoint, prompt, max_new_tokens, rounds, barrier, results) -> None:
    from specbench.api import outputs, run
    from specbench.worker.client import RemoteTarget

    remote = RemoteTarget(endpoint, timeout_s=120)
    run(remote, [prompt], method="target-only", max_new_tokens=max_new_tokens, progress=False, warmup=False)
    barrier.wait()
    start, emitted = time.perf_counter(), 0
    for _ in range(rounds):
        frame = run(remote, [prompt], method="target-only", max_new_tokens=max_new_tokens, progress=False,
                    warmup=False)
        emitted += len(outputs(frame)[("target-only", 0)])
    results.put((emitted, time.perf_counter() - start))


def measure(endpoint: str, clients: int, args) -> dict:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(clients), context.Queue()
    generator = torch.Generator().manual_seed(clients)
    prompts = [torch.randint(2, 512, (args.prompt_tokens,), generator=generator).tolist() for _ in range(clients)]
    processes = [context.Process(target=client, args=(endpoint, prompt, args.max_new_tokens, args.rounds, barrier,
                                                      results)) for prompt in prompts]
    for process in processes:
        process.start()
    done = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    tokens, seconds = sum(e for e, _ in done), max(s for _, s in done)
    return {"clients": clients, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ms_per_token_per_client": 1000 * seconds / (tokens / clients)}


PARTS = ["target_forward_s", "verify_s", "queue_s", "network_s", "overhead_s", "step_s"]


def breakdown(folder: str, args) -> list[dict]:
    """One client decoding `--breakdown-tokens` after the prompt, in this process (eager, then the device's
    default) and through each worker: mean seconds per step of each part the records keep, and the wall time."""
    from specbench.api import run
    from specbench.decode.target import LocalTarget
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget

    prompt = list(range(2, 2 + args.prompt_tokens))

    def parts(name: str, target) -> dict:
        run(target, [prompt], method="target-only", max_new_tokens=32, progress=False, warmup=False)  # warm-up
        started = time.perf_counter()
        frame = run(target, [prompt], method="target-only", max_new_tokens=args.breakdown_tokens, progress=False,
                    warmup=False)
        row = {"where": name, "wall_ms": 1000 * (time.perf_counter() - started) / len(frame)}
        row.update({part[:-2] + "_ms": 1000 * frame[part].mean() for part in PARTS})
        print(pd.DataFrame([row]).round(3).to_string(index=False), flush=True)
        return row

    loaded = load_model(ModelSpec(folder, dtype=args.dtype, device=args.device))
    rows = [parts(f"local, fast={fast}", LocalTarget(loaded, fast=fast)) for fast in (False, None)]
    del loaded
    for kind in args.workers:
        with serving(folder, kind, args) as endpoint:
            rows.append(parts(f"worker {kind}", RemoteTarget(endpoint)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--arch", default="qwen2.5-1.5b", choices=list(ARCHS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--workers", nargs="+", default=["eager", "eager-unbatched", "fast", "fast-unbatched"],
                        choices=list(WORKERS))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--breakdown", action="store_true", help="one client: each part of a step, local and remote")
    parser.add_argument("--breakdown-tokens", type=int, default=200)
    parser.add_argument("--chain", action="store_true",
                        help="chain SD with a trace-replayed draft under load: measured vs predicted tokens/s")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft-ms", type=float, default=12.0,
                        help="--chain: a client's drafting time per step (K forwards of its draft on its own device)")
    parser.add_argument("--out", default=str(RESULTS / "gpu-worker.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        save_model(args.arch, getattr(torch, args.dtype), folder)
        if args.chain:
            from gpu_chain_load import chain_load

            chain_load(folder, args)
            return
        if args.breakdown:
            rows = breakdown(folder, args)
            print(f"\n{device_name(args.device)}, {args.arch} {args.dtype}, ms per step:")
            print(pd.DataFrame(rows).round(3).to_string(index=False))
            write_report(args.out, {"device": device_name(args.device), "arch": args.arch, "dtype": args.dtype,
                                    "breakdown": rows, "args": vars(args)})
            return
        for kind in args.workers:
            with serving(folder, kind, args) as endpoint:
                for clients in args.clients:
                    rows.append({"worker": kind, **measure(endpoint, clients, args)})
                    print(pd.DataFrame(rows[-1:]).round(2).to_string(index=False, header=len(rows) == 1), flush=True)
    frame = pd.DataFrame(rows)
    table = frame.pivot(index="clients", columns="worker", values="tok_s")
    for a, b in (("fast", "eager"), ("eager", "eager-unbatched"), ("fast", "fast-unbatched")):
        if a in table and b in table:
            table[f"{a}/{b}"] = table[a] / table[b]
    print(f"\n{device_name(args.device)}, {args.arch} {args.dtype}, target-only, aggregate tokens/s:")
    print(table.round(2).to_string())
    write_report(args.out, {"device": device_name(args.device), "arch": args.arch, "dtype": args.dtype,
                            "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
