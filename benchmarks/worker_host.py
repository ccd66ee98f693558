"""The worker's own work per batch row, without sockets: what a shared target spends around its forward.

Why: on a GPU a verify forward takes a few ms, and the worker's Python per request (parsing, the step's
bookkeeping, building the batch's inputs and masks, verification, the reply) is a share of every step
that batching does not amortize. Here a `Worker` in this process gets rounds of verify messages from
`--rows` sessions at once (`handle_many`, as a round the I/O thread hands over) and each round is split
into the target's forward (the replies' `target_forward_s`) and the rest, per row.

    python benchmarks/worker_host.py                                   # tiny model, eager and static, 1-8 rows
    python benchmarks/worker_host.py --model smollm2-135m --fast off compile
    python benchmarks/worker_host.py --device cuda --model <dir> --fast off cudagraph   # on a GPU
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from specbench.models.spec import ModelSpec
from specbench.types import DraftTree, SamplingParams
from specbench.worker import protocol
from specbench.worker.inbox import Message
from specbench.worker.server import Worker, WorkerConfig

from common import RESULTS, write_report

CLIENT = "c" * 32


def message(header: dict, arrays=None) -> Message:
    return Message(b"bench", [], protocol.encode(dict({"client": CLIENT}, **header), arrays))


def open_sessions(worker: Worker, rows: int, prompt_tokens: int, vocab: int) -> dict[str, int]:
    """`rows` prefilled sessions: their names and committed lengths."""
    sessions = {}
    for row in range(rows):
        tokens = np.asarray([(row * 31 + i * 7) % (vocab - 10) + 5 for i in range(prompt_tokens)], dtype=np.int32)
        name = f"row{row}"
        worker.handle_many([message({"op": "prefill", "session": name, "epoch": 1}, {"tokens": tokens})])
        while worker.ops.jobs.jobs:
            worker.ops.jobs.advance_one()
        worker._finished_jobs()
        sessions[name] = prompt_tokens
    return sessions


def one_round(worker: Worker, sessions: dict[str, int], arrays: dict) -> tuple[float, float]:
    """Seconds of one round of verifies (every session one step) and of its forward."""
    sampling = protocol.sampling_to_wire(SamplingParams())
    messages = [message({"op": "verify", "session": name, "epoch": 1, "committed": committed,
                         "sampling": sampling, "seed": 0}, arrays) for name, committed in sessions.items()]
    started = time.perf_counter()
    replies = worker.handle_many(messages)
    seconds = time.perf_counter() - started
    forward = 0.0
    for name, (_, frames) in zip(sessions, replies):
        header, _ = protocol.decode(frames)
        if not header["ok"]:
            raise RuntimeError(f"verify failed: {header}")
        sessions[name] = header["committed"]
        forward = max(forward, header["target_forward_s"])
    return seconds, forward


def measure(model: str, device: str, fast: str, rows: int, args) -> dict:
    worker = Worker(WorkerConfig(model=ModelSpec(model, device=device), fast=fast), log=lambda line: None)
    vocab = worker.ops.ensure_loaded().vocab_size
    sessions = open_sessions(worker, rows, args.prompt_tokens, vocab)
    arrays = protocol.tree_to_arrays(DraftTree.chain([(7 * i) % (vocab - 10) + 5 for i in range(args.k)]))
    for _ in range(args.warmup):
        one_round(worker, sessions, arrays)
    samples = [one_round(worker, sessions, arrays) for _ in range(args.rounds)]
    total = statistics.median(s for s, _ in samples)
    forward = statistics.median(f for _, f in samples)
    host = statistics.median(s - f for s, f in samples)
    return {"model": model, "fast": fast, "rows": rows, "k": args.k, "round_ms": 1000 * total,
            "forward_ms": 1000 * forward, "host_ms": 1000 * host, "host_ms_per_row": 1000 * host / rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random:seed=0")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fast", nargs="+", default=["off", "static"], help="the worker's --fast, each in turn")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--k", type=int, default=4, help="draft tokens per verify (a chain)")
    parser.add_argument("--prompt-tokens", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2, help="passes over every setting, alternated")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=str(RESULTS / "worker-host.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [(fast, rows) for fast in args.fast for rows in args.rows]
    measured = []
    with tqdm(total=args.repeats * len(settings), desc="worker host work") as progress:
        for repeat in range(args.repeats):
            for fast, rows in settings:
                measured.append(dict(measure(args.model, args.device, fast, rows, args), repeat=repeat))
                progress.update()
    frame = pd.DataFrame(measured)
    table = frame.groupby(["model", "fast", "rows", "k"], as_index=False)[
        ["round_ms", "forward_ms", "host_ms", "host_ms_per_row"]].median()
    print(f"\nworker host work per round of verifies ({args.device}, median of {args.repeats} passes x "
          f"{args.rounds} rounds):")
    print(table.round(3).to_string(index=False))
    write_report(args.out, {"rows": measured, "table": table.to_dict("records"), "args": vars(args)})


if __name__ == "__main__":
    main()
