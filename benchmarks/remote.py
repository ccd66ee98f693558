"""Remote target benchmark: protocol overhead, bytes per step, remote vs local, RTT sweep, concurrency.

Workers run as real `specbench worker` processes on loopback. Prints tables and writes
results/remote.json. Network delay beyond loopback is EMULATED on the client and labelled so.

    python benchmarks/remote.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd

from specbench.api import outputs, run
from specbench.decode.metrics import tokens_per_second
from specbench.models.loading import load_model
from specbench.models.self_draft import truncated_view
from specbench.models.spec import ModelSpec
from specbench.types import DraftTree, SamplingParams, SparseDist
from specbench.worker import protocol
from specbench.worker.client import NetworkEmulation, RemoteTarget
from specbench.worker.launch import free_port, spawn_worker

from common import write_report

ROOT = Path(__file__).resolve().parents[1]
TINY = "tiny-random:seed=0"
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "List three uses of a hash map, one sentence each."]


def protocol_overhead(endpoint: str, steps: int) -> dict:
    """Client round trip minus the worker's own handling time, for verify steps of a 4-token chain."""
    remote = RemoteTarget(endpoint)
    remote.prefill("bench", list(range(1, 33)))
    overheads, worker_times = [], []
    for step in range(steps):
        verdict = remote.verify("bench", DraftTree.chain([5, 6, 7, 8]), SamplingParams(), step)
        overheads.append(verdict.network_s)  # round trip minus the worker's own time
        worker_times.append(verdict.verify_s)
        if step % 50 == 49:  # keep the context short and constant
            remote.prefill("bench", list(range(1, 33)))
    overheads_ms = np.array(overheads[10:]) * 1000
    return {"steps": len(overheads_ms), "p50_ms": float(np.percentile(overheads_ms, 50)),
            "p99_ms": float(np.percentile(overheads_ms, 99)), "mean_ms": float(overheads_ms.mean()),
            "worker_ms_p50": 1000 * float(np.median(worker_times))}


def _echo(endpoint):
    import zmq

    socket = zmq.Context().socket(zmq.ROUTER)
    socket.bind(endpoint)
    while True:
        frames = socket.recv_multipart()
        socket.send_multipart(frames)
        if frames[-1] == b"stop":
            return


def zmq_floor(idle_s: float, steps: int) -> dict:
    """Bare pyzmq ROUTER/DEALER echo between two processes, idling `idle_s` between round trips as a
    client does while the worker computes: the platform's floor, which no protocol can go under.
    (On small VMs a core idle for a few ms wakes slowly; this isolates that from our own cost.)"""
    import zmq

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = multiprocessing.get_context("spawn").Process(target=_echo, args=(endpoint,))
    server.start()
    client = zmq.Context().socket(zmq.DEALER)
    client.connect(endpoint)
    times = []
    for _ in range(steps):
        time.sleep(idle_s)
        started = time.perf_counter()
        client.send_multipart([b"", b"x" * 200])
        client.recv_multipart()
        times.append(time.perf_counter() - started)
    client.send_multipart([b"", b"stop"])
    server.join()
    client.close(linger=0)
    ms = np.array(times[10:]) * 1000
    return {"idle_between_ms": 1000 * idle_s, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def light_op_overhead(endpoint: str, steps: int) -> dict:
    """Round trip minus worker time for `health` (no model work, so no idle gap before the reply)."""
    remote = RemoteTarget(endpoint)
    overheads = []
    for _ in range(steps):
        started = time.perf_counter()
        reply, _, _ = remote._request({"op": "health"}, with_timing=True)
        overheads.append(time.perf_counter() - started - reply["worker_s"])
    ms = np.array(overheads[10:]) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def bytes_per_step() -> list[dict]:
    def size(tree, sampling):
        frames = protocol.encode({"op": "verify", "session": "0123456789ab-default", "id": 123456, "epoch": 1, "committed": 4096,
                                  "client": "0" * 32,
                                  "seed": 2**61, "sampling": protocol.sampling_to_wire(sampling)},
                                 protocol.tree_to_arrays(tree))
        return sum(len(f) for f in frames)

    rng = np.random.default_rng(0)
    parents = tuple([-1] * 10 + [i // 10 for i in range(140)])  # 150 nodes, width 10 then 10 per node
    tokens = tuple(int(t) for t in rng.integers(0, 151_936, 150))
    greedy_tree = DraftTree(tokens, parents)
    # sampled tree: siblings share their parent's q (top-32), so one q per internal node travels
    q_by_parent = {p: SparseDist(tuple(int(t) for t in rng.integers(0, 151_936, 32)),
                                 tuple(float(x) for x in rng.dirichlet(np.ones(32)))) for p in set(parents)}
    sampled_tree = DraftTree(tokens, parents, tuple(q_by_parent[p] for p in parents))
    chain_q = [SparseDist(tuple(int(t) for t in rng.integers(0, 151_936, 32)),
                          tuple(float(x) for x in rng.dirichlet(np.ones(32)))) for _ in range(8)]
    chain = DraftTree.chain([q.ids[0] for q in chain_q], chain_q)
    sampling = SamplingParams(temperature=1.0, rule="rejection")
    json_estimate = len(json.dumps({"tokens": list(tokens), "parents": list(parents),
                                    "mask": [[1] * 150 for _ in range(150)]}))
    return [{"payload": "150-node tree, greedy (no q)", "bytes": size(greedy_tree, SamplingParams())},
            {"payload": "150-node tree, sampling (q top-32 per parent)", "bytes": size(sampled_tree, sampling)},
            {"payload": "8-token chain, sampling (q top-32 per node)", "bytes": size(chain, sampling)},
            {"payload": "for scale: JSON tokens+parents+dense 150x150 mask", "bytes": json_estimate}]


def remote_vs_local(endpoint: str, target_spec: ModelSpec, draft, max_new_tokens: int) -> dict:
    local = run(target_spec, PROMPTS, method=["target-only", "chain"], draft=draft, max_new_tokens=max_new_tokens,
                progress=False)
    remote_target = RemoteTarget(endpoint, model=target_spec)
    tokenizer = draft.tokenizer
    remote = run(remote_target, PROMPTS, method=["target-only", "chain"], draft=draft,
                 max_new_tokens=max_new_tokens, progress=False, tokenizer=tokenizer)
    rows = []
    for method in ("target-only", "chain"):
        local_tps = tokens_per_second(local[local.method == method])
        remote_tps = tokens_per_second(remote[remote.method == method])
        identical = all(outputs(local)[(method, i)] == outputs(remote)[(method, i)] for i in range(len(PROMPTS)))
        rows.append({"method": method, "local_tps": local_tps, "remote_tps": remote_tps,
                     "remote_over_local": remote_tps / local_tps, "identical_outputs": identical})
    return rows


def rtt_sweep(endpoint: str, target_spec: ModelSpec, draft, rtts, max_new_tokens: int) -> list[dict]:
    rows = []
    for rtt in rtts:
        remote_target = RemoteTarget(endpoint, model=target_spec, network=NetworkEmulation(rtt_ms=rtt, jitter_ms=rtt / 10))
        records = run(remote_target, PROMPTS, method=["target-only", "chain", "prompt-lookup"], draft=draft,
                      max_new_tokens=max_new_tokens, progress=False, tokenizer=draft.tokenizer)
        speeds = {m: tokens_per_second(g) for m, g in records.groupby("method")}
        rows.append({"emulated_rtt_ms": rtt, **{f"{m}_tps": v for m, v in speeds.items()},
                     "chain_speedup": speeds["chain"] / speeds["target-only"],
                     "prompt_lookup_speedup": speeds["prompt-lookup"] / speeds["target-only"],
                     "emulated_network_s_per_step": float(records["emulated_network_s"].mean())})
    return rows


def _client(endpoint, seed, steps, queue):
    remote = RemoteTarget(endpoint)
    prompt = [1 + (seed + i) % 90 for i in range(16)]
    latencies = []
    started = time.perf_counter()
    remote.prefill("c", prompt)
    for step in range(steps):
        t0 = time.perf_counter()
        remote.verify("c", DraftTree.chain([3, 4, 5, 6]), SamplingParams(), step)
        latencies.append(time.perf_counter() - t0)
    queue.put({"tokens": len(remote.committed("c")) - len(prompt), "seconds": time.perf_counter() - started,
               "median_step_ms": 1000 * statistics.median(latencies)})


def concurrency(endpoint: str, clients_list, steps: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for clients in clients_list:
        queue = context.Queue()
        processes = [context.Process(target=_client, args=(endpoint, i, steps, queue)) for i in range(clients)]
        for process in processes:
            process.start()
        results = [queue.get(timeout=600) for _ in processes]
        for process in processes:
            process.join()
        wall = max(r["seconds"] for r in results)
        rows.append({"clients": clients, "aggregate_tokens_per_s": sum(r["tokens"] for r in results) / wall,
                     "median_step_ms": statistics.median(r["median_step_ms"] for r in results)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and tokens (a smoke run)")
    parser.add_argument("--protocol-only", action="store_true", help="only overhead, floor and bytes (tiny model)")
    parser.add_argument("--out", default=str(ROOT / "results" / "remote.json"))
    args = parser.parse_args()
    steps = 200 if args.quick else 2000
    max_new = 16 if args.quick else 48
    pd.set_option("display.width", 200)
    report = {"note": "loopback; RTT values are emulated on the client"}

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(endpoint, "--model", TINY)
    try:
        report["protocol_overhead"] = protocol_overhead(endpoint, steps)
        report["light_op_overhead"] = light_op_overhead(endpoint, steps)
        report["zmq_floor"] = [zmq_floor(0.0, steps),
                               zmq_floor(report["protocol_overhead"]["worker_ms_p50"] / 1000, steps)]
        print("== protocol overhead (round trip - worker time), tiny model, loopback ==")
        print(pd.DataFrame([report["protocol_overhead"]]).round(3).to_string(index=False))
        print("-- the same for `health` (no compute, so no idle gap):")
        print(pd.DataFrame([report["light_op_overhead"]]).round(3).to_string(index=False))
        print("-- bare pyzmq echo between two processes (platform floor), without and with the same idle gap:")
        print(pd.DataFrame(report["zmq_floor"]).round(3).to_string(index=False))
        report["concurrency"] = concurrency(endpoint, [1, 2, 4, 8], 20 if args.quick else 100)
        print("\n== concurrent clients (tiny model, separate processes, 4-token chain verifies) ==")
        print(pd.DataFrame(report["concurrency"]).round(2).to_string(index=False))
    finally:
        worker.terminate()
    report["bytes_per_step"] = bytes_per_step()
    print("\n== bytes per verify request ==")
    print(pd.DataFrame(report["bytes_per_step"]).to_string(index=False))

    if args.protocol_only:
        write_report(args.out, report)
        return
    target_spec = ModelSpec("smollm2-135m")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(endpoint, "--model", "smollm2-135m")
    try:
        # The draft: SmolLM2's own first 26 layers, loaded in this (client) process.
        draft = truncated_view(load_model(target_spec), 26)
        report["remote_vs_local"] = remote_vs_local(endpoint, target_spec, draft, max_new)
        print("\n== remote vs local, SmolLM2-135M target, self-draft (26 layers) chain K=4, greedy ==")
        print(pd.DataFrame(report["remote_vs_local"]).round(3).to_string(index=False))
        rtts = [0, 50] if args.quick else [0, 10, 50, 100]
        report["rtt_sweep"] = rtt_sweep(endpoint, target_spec, draft, rtts, max_new)
        print("\n== tokens/s vs EMULATED RTT (same pair) ==")
        print(pd.DataFrame(report["rtt_sweep"]).round(3).to_string(index=False))
    finally:
        worker.terminate()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
