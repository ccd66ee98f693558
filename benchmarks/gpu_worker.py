"""A worker on the GPU under load: aggregate tokens/s of 1..8 clients against eager and fast workers,
batched and not, each a real `specbench worker --device cuda` on loopback.

Weights are random (a step's time depends on shapes, not values): the architecture is written to a
local model directory with a word-level tokenizer made here, and the worker loads it like any other
path. Clients are processes decoding target-only (prompts of random ids), starting together after a
warm-up round that lets the fast worker capture its batch shapes; each decodes `--rounds` prompts of
`--max-new-tokens` tokens. What it shows: how much of a fast step the worker's own per-step work (the
loopback round trip, Python, the host side of a batch) leaves, and what batching buys on a GPU.

    python benchmarks/gpu_worker.py                       # on CUDA: qwen2.5-1.5b in bf16
    python benchmarks/gpu_worker.py --device cpu --arch tiny --dtype float32 --workers eager fast-static
"""
from __future__ import annotations

import argparse
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
    """The architecture with random weights and a 512-word tokenizer, as a directory `load_model` reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = build(arch, dtype, "cpu")
    model.generation_config.eos_token_id = None  # random weights: decode every token asked for
    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(folder)


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
    parser.add_argument("--out", default=str(RESULTS / "gpu-worker.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        save_model(args.arch, getattr(torch, args.dtype), folder)
        for kind in args.workers:
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            worker = spawn_worker(endpoint, "--model", folder, "--device", args.device, "--dtype", args.dtype,
                                  *WORKERS[kind], timeout_s=600)
            try:
                for clients in args.clients:
                    rows.append({"worker": kind, **measure(endpoint, clients, args)})
                    print(pd.DataFrame(rows[-1:]).round(2).to_string(index=False, header=len(rows) == 1), flush=True)
            finally:
                worker.terminate()
                worker.wait(30)
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
