"""How long one tenant's longest allowed request holds another tenant's decoding, on a real worker.

Why: a shared worker must not let one user starve the others (the brief). Here a victim client decodes
greedy target-only through a `specbench worker` process, prompt after prompt, while another client
sends one long request that the worker's default limits allow: a profile point (256 tokens on a
4,096-token context, 20 repeats), a server-only generate with a long prompt, suffix decoding on the worker
drafting 256-node trees, or a 4,096-token prefill.
Each row is one such request beside the victim: the victim's median and worst step, how long the
other request took, and whether every victim output equals the victim's undisturbed run.

    python benchmarks/worker_fairness.py                       # SmolLM2-135M, every scenario
    python benchmarks/worker_fairness.py --scenarios none prefill --repeat 2
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import pandas as pd

from specbench.decode.loop import Decoding, generate
from specbench.worker.client import RemoteTarget
from specbench.worker.launch import free_port, spawn_worker
from specbench.worker import protocol

from common import RESULTS, write_report

SCENARIOS = {
    "none": None,
    # the longest profile point the limits allow (tokens: the slice, 256 by default; one client sent exactly this)
    "profile": "profile",
    "generate": "generate",  # built from the vocabulary: a long prompt, server-only target decoding
    # suffix decoding on the worker at the largest K the limits allow (--max-tree-nodes: its lookups are no draft
    # forwards), over a prompt whose last tokens continue many ways: its first step verifies a tree that wide
    "suffix-generate": "suffix-generate",
    "prefill": "prefill",
}


class Victim:
    """Decodes prompt after prompt until told to stop; keeps every step's wall time and every output."""

    def __init__(self, endpoint: str, prompt: list[int], tokens: int):
        self.remote = RemoteTarget(endpoint, timeout_s=600)
        self.prompt, self.tokens = prompt, tokens
        self.steps, self.outputs = [], []
        self.stop = threading.Event()

    def run(self) -> None:
        original = self.remote.verify

        def timed(*args, **kwargs):
            started = time.perf_counter()
            verdict = original(*args, **kwargs)
            self.steps.append(time.perf_counter() - started)
            return verdict

        self.remote.verify = timed
        while not self.stop.is_set():
            self.outputs.append(generate(self.remote, None, self.prompt, Decoding(0, self.tokens, kind="none"),
                                         session="victim").output_ids)


def long_request(name: str, vocab: int, prompt_tokens: int, slice_tokens: int) -> tuple[dict, dict | None]:
    scenario = SCENARIOS[name]
    if scenario == "profile":
        return {"op": "profile", "tokens": [slice_tokens], "contexts": [prompt_tokens], "batches": [1],
                "repeats": 20}, None
    tokens = np.asarray([(i * 7919) % (vocab - 10) + 5 for i in range(prompt_tokens)], dtype=np.int32)
    if scenario == "generate":
        return ({"op": "generate", "method": "server-only-ar", "k": 1, "max_new_tokens": 32,
                 "sampling": {"temperature": 0.0}, "seed": 0}, {"tokens": tokens})
    if scenario == "suffix-generate":  # the pair (3, 4) followed by 128 different 8-token runs, and last
        runs = [[3, 4] + [(r * 8 + j) * 37 % (vocab - 10) + 5 for j in range(8)] for r in range(128)]
        wide = np.asarray([t for run in runs for t in run][-prompt_tokens + 2:] + [3, 4], dtype=np.int32)
        return ({"op": "generate", "method": "suffix-tree-server", "k": 256, "max_new_tokens": 32,
                 "sampling": {"temperature": 0.0}, "seed": 0,  # the request's knobs: every branch, any length
                 "suffix": {"factor": 100.0, "offset": 256.0, "min_prob": 0.0}}, {"tokens": wide})
    return {"op": "prefill", "session": "long", "epoch": 1}, {"tokens": tokens}


def run_scenario(endpoint: str, name: str, prompt: list[int], tokens: int, reference: list[int], vocab: int,
                 prompt_tokens: int, slice_tokens: int) -> dict:
    import zmq

    victim = Victim(endpoint, prompt, tokens)
    thread = threading.Thread(target=victim.run, daemon=True)
    thread.start()
    time.sleep(2.0)  # the victim is decoding at its own pace
    before = len(victim.steps)
    request_s, ok = 0.0, True
    if SCENARIOS[name] is not None:
        header, arrays = long_request(name, vocab, prompt_tokens, slice_tokens)
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.connect(endpoint)
        started = time.perf_counter()
        socket.send_multipart([b"", *protocol.encode(dict(header, client="a" * 32), arrays)])
        socket.poll(900_000)
        reply, _ = protocol.decode(socket.recv_multipart()[1:])
        request_s, ok = time.perf_counter() - started, bool(reply.get("ok"))
        if not ok:
            print(f"  {name}: refused ({reply.get('code')}): {reply.get('error')}")
        socket.close(0)
    else:
        time.sleep(5.0)
    victim.stop.set()
    thread.join(600)
    during = victim.steps[before:]
    return {"scenario": name, "request_s": round(request_s, 2), "request_ok": ok, "victim_steps": len(during),
            "median_step_s": round(statistics.median(during), 3), "worst_step_s": round(max(during), 3),
            "outputs": len(victim.outputs), "identical": all(o == reference for o in victim.outputs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--prompt-tokens", type=int, default=3840,
                        help="the long prefill's and generate's prompt, and the profile point's context")
    parser.add_argument("--slice-tokens", type=int, help="the worker's --slice-tokens (default: the worker's own)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per victim prompt")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--worker-args", nargs="*", default=[], help="extra `specbench worker` flags")
    parser.add_argument("--out", default=str(RESULTS / "worker_fairness.json"))
    args = parser.parse_args()

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    slicing = ["--slice-tokens", str(args.slice_tokens)] if args.slice_tokens else []
    process = spawn_worker(endpoint, "--model", args.model, *slicing, *args.worker_args)
    try:
        probe = RemoteTarget(endpoint)
        vocab = probe.vocab_size
        prompt = [(i * 31) % (vocab - 10) + 5 for i in range(48)]
        reference = generate(probe, None, prompt, Decoding(0, args.tokens, kind="none"), session="ref").output_ids
        probe.disconnect()
        rows = []
        for attempt in range(args.repeat):
            for name in args.scenarios:
                row = run_scenario(endpoint, name, prompt, args.tokens, reference, vocab, args.prompt_tokens,
                                   args.slice_tokens or 256)
                rows.append(dict(row, attempt=attempt, slice_tokens=args.slice_tokens or 256))
                print(row, flush=True)
    finally:
        process.terminate()
        process.wait(30)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    write_report(args.out, {"model": args.model, "worker_args": slicing + args.worker_args, "rows": rows})


if __name__ == "__main__":
    main()
