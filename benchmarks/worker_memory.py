"""A worker's resident memory under many sessions, and after they all closed.

Why: a shared worker's KV pool grows to its longest session times its rows; it used to keep that
memory after every session closed (1.0 -> 4.1 GB under 8 clients, staying there). Here `--clients`
raw clients each prefill a `--prompt-tokens` prompt and take `--steps` verifies on a real
`specbench worker` process; its RSS is read before, under load, and after every session closed.

    python benchmarks/worker_memory.py                     # SmolLM2-135M, 8 clients x 2,000 tokens
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import psutil

from specbench.types import DraftTree
from specbench.worker import protocol
from specbench.worker.launch import free_port, spawn_worker

from common import RESULTS, write_report


def request(socket, header: dict, arrays=None) -> dict:
    socket.send_multipart([b"", *protocol.encode(header, arrays)])
    assert socket.poll(600_000), f"no reply to {header['op']}"
    return protocol.decode(socket.recv_multipart()[1:])[0]


def main() -> None:
    import zmq

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "worker_memory.json"))
    args = parser.parse_args()

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = spawn_worker(endpoint, "--model", args.model)
    memory = psutil.Process(process.pid)
    mib = lambda: memory.memory_info().rss / 2**20  # noqa: E731
    rows = [{"phase": "started", "rss_mib": round(mib())}]
    try:
        sockets = []
        for index in range(args.clients):
            socket = zmq.Context.instance().socket(zmq.DEALER)
            socket.connect(endpoint)
            sockets.append(socket)
        client = lambda i: f"client{i:02d}" + "x" * 16  # noqa: E731
        for index, socket in enumerate(sockets):
            tokens = np.asarray([(t * 7 + index) % 40000 + 5 for t in range(args.prompt_tokens)], np.int32)
            reply = request(socket, {"op": "prefill", "client": client(index), "session": "s", "epoch": 1},
                            {"tokens": tokens})
            assert reply["ok"], reply
            for step in range(args.steps):
                reply = request(socket, {"op": "verify", "client": client(index), "session": "s", "epoch": 1,
                                         "committed": reply["committed"], "seed": 0, "sampling": {"temperature": 0.0}},
                                protocol.tree_to_arrays(DraftTree.chain([5, 6, 7])))
                assert reply["ok"], reply
        info = request(sockets[0], {"op": "info", "client": client(0)})
        rows.append({"phase": f"{args.clients} sessions open", "rss_mib": round(mib()),
                     "kv_pool_mib": round(info["kv_pool"]["bytes"] / 2**20)})
        for index, socket in enumerate(sockets):
            request(socket, {"op": "close", "client": client(index), "session": "s"})
        time.sleep(2.0)
        info = request(sockets[0], {"op": "info", "client": client(0)})
        rows.append({"phase": "every session closed", "rss_mib": round(mib()),
                     "kv_pool_mib": round(info["kv_pool"]["bytes"] / 2**20)})
    finally:
        process.terminate()
        process.wait(30)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    write_report(args.out, {"model": args.model, "clients": args.clients, "prompt_tokens": args.prompt_tokens,
                            "rows": rows})


if __name__ == "__main__":
    main()
