"""Many clients, one worker: aggregate tokens/s and per-client latency with batching on and off, one run.

1, 2, 4, 8 client processes (each its own prompt) decode at once against a `specbench worker` on
loopback (one mt-bench prompt each), against a worker with batched verification and one with
`--no-batching`, measured back to back per setting (order alternating) after a discarded warm-up; target-only and prompt-lookup
SD (drafting costs the clients nothing, so the worker is what is measured); "prompt-lookup+planner"
lets the step planner choose K per step from this machine's batch-grid profile of the target and the
prompt-lookup reference, following the batch size the worker reports (shorter lookups under load); with `--draft`,
`--methods target-only chain` runs a draft model in every client process (on this box the clients'
drafts and the worker share the same cores, which the measurement then includes), or with `--draft-replay`
emulates clients on other hosts (the draft runs alone here first; each client replays its proposals,
sleeping the seconds each took: `decode/replay_drafter.py`). Every greedy output is
compared with the same prompt decoded alone in this process (fp32 by default, `--dtype`); a difference is shown
with the target's logits of both tokens at the first differing one (a near-tie means batched shapes changed the
rounding). With batching on, SD's speedup over target-only per client count is also predicted
from the alone run's steps, priced on the shipped profile's batch grid of the target plus the
loopback round trip, two ways, each printed with its error against the measured one: this run
(`plan.replay.replay_together`: the clients start together and the ones that accept more finish
first, leaving part-full batches) and steady state (`plan.replay.replay_speed`: every batch full).

By default each client decodes a fixed number of prompts (`--rounds`), so a run ends with a tail in which
the clients that accepted more have finished and batches are part-full (prompt lookup's clients need 8
to 24 steps for 24 tokens). `--duration S` measures steady load instead: every client decodes prompt
after prompt (its own share of the prompt set) for S seconds, and only the steps that ended inside the
window count, with all clients decoding throughout. `--workers` adds workers on the fast path (`--fast`:
fixed-shape steps over a static pool, batched verifies padded to a bucket), warmed up at every client
count before measuring, since each new batch x step shape compiles. Prints tables and writes
results/concurrency-<pair>.json.

    python benchmarks/concurrency.py [--pair smollm2|qwen] [--clients 1 2 4 8] [--max-new-tokens 24] [--duration S]
                                     [--methods target-only prompt-lookup prompt-lookup+planner]
                                     [--kernels default|onednn] [--methods target-only chain --draft M]
                                     [--workers batched unbatched fast-batched fast-unbatched]
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import multiprocessing
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import torch

from specbench.api import encode_prompts, outputs, run
from specbench.decode.divergence import divergence
from specbench.decode.loop import Decoding, generate
from specbench.datasets import load_prompts
from specbench.hardware import device_name
from specbench.plan.library import load_profiles
from specbench.plan.replay import replay_speed, replay_together
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec, acceptance_label
from specbench.worker.launch import free_port, spawn_worker

from common import write_report

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"smollm2": "smollm2-135m", "qwen": "qwen2.5-coder-1.5b"}


_client_draft = None  # each client process's draft model, loaded once when the pool starts
_client_replay = None  # or, with --draft-replay, the draft's recorded proposals (decode/replay_drafter.py)


def load_client_draft(spec, proposals=None) -> None:
    global _client_draft, _client_replay
    torch.set_num_threads(1)
    _client_draft = load_model(spec) if spec is not None and proposals is None else None
    _client_replay = proposals


def decode_one(remote, prompt, job: dict) -> tuple[list[int], pd.DataFrame, int]:
    """One prompt's output, step records and replay misses: through `run`, or with a replayed draft
    through the loop itself (`run` builds its drafters from models)."""
    if _client_replay is None or job["method"] != "chain":
        records = run(remote, [prompt], method=job["method"].removesuffix("+planner"), k=job["k"],
                      max_new_tokens=job["max_new_tokens"], draft=_client_draft, planner=job["planner"],
                      progress=False, warmup=False)
        return outputs(records)[(job["method"], 0)], records, 0
    from specbench.decode.replay_drafter import ReplayDrafter

    drafter = ReplayDrafter(_client_replay)
    result = generate(remote, drafter, prompt, Decoding(job["k"], job["max_new_tokens"], method="chain", kind="chain"))
    return result.output_ids, pd.DataFrame([asdict(record) for record in result.records]), drafter.misses


def client_job(job: dict) -> list[dict]:
    """One client process's decodes, started at the shared `go` time: its prompts once each, or with a
    `deadline`, round and round until it passes (the prompt under way then runs to its end, so every
    client is still decoding when the measured window closes). One dict per prompt decoded."""
    from specbench.worker.client import RemoteTarget

    torch.set_num_threads(1)
    remote = RemoteTarget(job["endpoint"], timeout_s=900)
    time.sleep(max(0.0, job["go"] - time.perf_counter()))
    decoded, started = [], time.perf_counter()
    for index, prompt in itertools.cycle(job["prompts"]) if job["deadline"] else job["prompts"]:
        if job["deadline"] and started >= job["deadline"]:
            break
        output, records, misses = decode_one(remote, prompt, job)
        ended = time.perf_counter()
        decoded.append({"prompt": index, "started": started, "ended": ended, "output": output, "misses": misses,
                        **{column: records[column].tolist() for column in STEP_COLUMNS}})
        started = ended
    return decoded


STEP_COLUMNS = ("step_s", "emitted", "queue_s", "batch_size", "step_k", "drafted")


def prompt_share(prompts, args) -> int:
    """How many prompts each client owns: client i's are i * share onwards (steady load: the set split
    between the most clients measured; fixed work: its `--rounds`)."""
    return len(prompts) // max(args.clients) if args.duration and not args.draft_replay else args.rounds


def client_prompts(prompts, share: int, client: int, count: int) -> list[tuple[int, list[int]]]:
    """(index, prompt) of the `count` prompts client `client` decodes: its own, from client * share on."""
    return [(j, prompts[j]) for j in range(client * share, client * share + count)]


def step_ends(decoded: dict) -> np.ndarray:
    """When each step of a prompt's decode ended, counted back from the decode's end (a step's records
    carry its duration, not its time)."""
    step_s = np.asarray(decoded["step_s"])
    return decoded["ended"] - (np.cumsum(step_s[::-1])[::-1] - step_s)


def measure(pool, endpoint: str, prompts, method: str, clients: int, args, steady: bool = True,
            count: Optional[int] = None) -> dict:
    """A row of the table. Fixed work (default): each client decodes its `--rounds` prompts, aggregate =
    every token / the run's wall time, including the tail where the clients that accepted more have
    finished. `--duration S`: every client decodes for S seconds; aggregate = tokens of the steps that
    ended inside the window / S, with all `clients` decoding throughout (steady load)."""
    go = time.perf_counter() + 3.0  # every client connected and waiting before any starts
    planner = planner_for(method, args, "remote")  # each job pickles its own copy
    deadline = go + args.duration if args.duration and steady else None
    share = prompt_share(prompts, args)
    count = share if deadline else count or args.rounds  # (a warm-up decodes `rounds` of them, or `count`)
    jobs = [{"endpoint": endpoint, "method": method, "k": args.k,
             "prompts": client_prompts(prompts, share, i, count),
             "max_new_tokens": args.max_new_tokens, "go": go, "deadline": deadline, "planner": planner}
            for i in range(clients)]
    shapes_before, before = worker_state(endpoint)
    decoded = [d for client in pool.map(client_job, jobs, chunksize=1) for d in client]
    shapes_after, after = worker_state(endpoint)
    busy = {op: seconds - before["busy_s"].get(op, 0.0) for op, seconds in after["busy_s"].items()}
    run_s = max(d["ended"] for d in decoded) - go
    if deadline is None:
        window, inside = run_s, lambda d: np.ones(len(d["step_s"]), bool)
    else:
        window = args.duration

        def inside(d):
            ends = step_ends(d)
            return (ends >= go) & (ends < deadline)
    steps = {column: np.concatenate([np.asarray(d[column])[inside(d)] for d in decoded]) for column in STEP_COLUMNS}
    return {"clients": clients, "method": method, "aggregate_tokens_per_s": steps["emitted"].sum() / window,
            "step_ms_p50": float(np.percentile(steps["step_s"], 50) * 1000),
            "step_ms_p99": float(np.percentile(steps["step_s"], 99) * 1000),
            "queue_ms_p50": float(np.percentile(steps["queue_s"], 50) * 1000),
            "queue_ms_p99": float(np.percentile(steps["queue_s"], 99) * 1000),
            "mean_batch": float(np.mean(steps["batch_size"])),
            # K asked for per step (a planner's choice; else the run's K) and tokens actually drafted
            "mean_k": float(np.mean(steps["step_k"])), "mean_drafted": float(np.mean(steps["drafted"])),
            "prompts_decoded": len(decoded),
            "replay_misses": sum(d["misses"] for d in decoded),  # --draft-replay: contexts never met alone
            # a fast worker's step shapes first met (each compiled, stalling the batch) while measured
            "new_shapes": None if shapes_after is None else shapes_after - shapes_before,
            # the worker's time computing, from the start to the last client's end (steady load: its last
            # prompt runs past the window), and the share of it in prefills, which do not batch: with
            # short outputs they cap what batching the steps can gain
            "worker_busy": sum(busy.values()) / run_s,
            "prefill_share": busy.get("prefill", 0.0) / max(sum(busy.values()), 1e-9),
            # seconds gathering batches (waiting for the other clients), and a forward's fixed cost as the
            # worker fitted it on its batches (what `--batch-wait-ms auto` waits at most)
            "batch_wait_share": (after.get("batch_wait_s", 0.0) - before.get("batch_wait_s", 0.0)) / run_s,
            "forward_fixed_ms": None if after.get("forward_fixed_s") is None else after["forward_fixed_s"] * 1000,
            "outputs": [(d["prompt"], d["output"]) for d in decoded]}


def worker_state(endpoint: str) -> tuple[Optional[int], dict]:
    """How many step shapes a fast worker has met so far (None: not a fast worker), and its `stats`
    (seconds computed so far per op, seconds gathering batches, the fitted forward cost)."""
    from specbench.worker.client import RemoteTarget

    remote = RemoteTarget(endpoint)
    fast, stats = remote.info.get("fast"), remote.stats()
    remote.disconnect()
    return None if fast is None else fast["shapes"], stats


def planner_for(method: str, args, where: str):
    """A step planner for "<method>+planner" (K per step from this machine's profile of the target and the
    pair's reference; remote, it follows the worker's batch size: shorter drafts under load), else None."""
    if not method.endswith("+planner"):
        return None
    from specbench.plan.step_planner import planner_from_caches

    return planner_from_caches(target_spec(args).label, draft_spec(args).label if args.draft else "prompt-lookup",
                               dataset=args.dataset, device=device_name("cpu"), dtype=args.dtype, where=where,
                               max_k=args.k)


def target_spec(args) -> ModelSpec:
    return ModelSpec(TARGETS[args.pair], dtype=args.dtype, kernels=args.kernels)


def draft_spec(args):
    """Each client's own draft model for `chain` (each client process loads one), or None."""
    return ModelSpec(args.draft, quantization=args.draft_quant) if args.draft else None


# "batched-wait": a batched worker given the benchmark's --batch-wait-ms (default 0: the fixed window only)
# instead of the worker's default (auto: `specbench worker --batch-wait-ms`); `--fast` for the last two
WORKERS = ("batched", "batched-wait", "unbatched", "fast-batched", "fast-unbatched")


class Workers:
    """The workers compared (`WORKERS`), one process each. With `one_at_a_time` only the one in use is alive
    (started afresh, and warmed up, at each switch), which leaves a target's memory to the clients' drafts."""

    def __init__(self, spec: ModelSpec, one_at_a_time: bool, batch_window_ms: Optional[float] = None,
                 fast_backend: str = "compile", batch_wait_ms: str = "0"):
        self.spec, self.one_at_a_time, self.batch_window_ms = spec, one_at_a_time, batch_window_ms
        self.batch_wait_ms = batch_wait_ms
        self.fast_backend = fast_backend
        self.live = {}  # kind -> (endpoint, process)

    def endpoint(self, kind: str, warm) -> str:
        if kind not in self.live:
            if self.one_at_a_time:
                self.stop()
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            self.live[kind] = (endpoint, spawn_worker(endpoint, "--model", self.spec.model, "--dtype",
                                                      self.spec.dtype, "--kernels", self.spec.kernels,
                                                      *self._flags(kind)))
            if self.one_at_a_time:
                warm(endpoint, 1)
        return self.live[kind][0]

    def _flags(self, kind: str) -> list[str]:
        fast = ["--fast", self.fast_backend] if kind.startswith("fast-") else []
        if kind.endswith("unbatched"):
            return fast + ["--no-batching"]
        wait = ["--batch-wait-ms", str(self.batch_wait_ms)] if kind == "batched-wait" else []
        return fast + wait + ([] if self.batch_window_ms is None else ["--batch-window-ms", str(self.batch_window_ms)])

    def stop(self) -> None:
        for _, process in self.live.values():
            process.terminate()
            process.wait()
        self.live.clear()


def check_memory(target_bytes: int, workers: int, clients: int, args) -> None:
    """Refuse, naming the numbers, a run whose workers and `clients` drafts would not fit in memory:
    two 1.5B fp32 workers and an fp32 0.5B draft in each of 2 client processes got a worker OOM-killed.
    Resident memory runs ~1.1x the weights (a 1.5B fp32 worker: 7.2 GiB for 6.6 GiB of weights), plus
    ~0.5 GiB of runtime per client process (this process is already out of what is free). An int8-dynamic
    draft is counted at its fp32 size: it is quantized after an fp32 load and its process keeps that peak
    (Qwen2.5-Coder-0.5B: 2.9 GB resident per client process for 1.0 GiB of int8 weights)."""
    from specbench.models.loading import available_bytes

    loaded_as = ModelSpec(args.draft) if args.draft_quant == "int8-dynamic" else draft_spec(args)
    draft_bytes = load_model(loaded_as).weight_bytes if args.draft and not args.draft_replay else 0
    gc.collect()
    needed = 1.15 * (workers * target_bytes + clients * draft_bytes) + 0.5 * 2**30 * clients
    free = available_bytes("cpu")
    if free and needed > 0.9 * free:
        raise SystemExit(f"{workers} workers x {target_bytes / 2**30:.1f} GiB + {clients} client drafts x "
                         f"{draft_bytes / 2**30:.1f} GiB need ~{needed / 2**30:.1f} GiB resident, more than 90% of "
                         f"the {free / 2**30:.1f} GiB free here: --one-worker, fewer --clients, or a quantized --draft-quant")


def decode_alone(loaded, prompts, method: str, args):
    draft = _reference_model(draft_spec(args)) if args.draft else None
    return run(loaded, prompts, method=method.removesuffix("+planner"), k=args.k, max_new_tokens=args.max_new_tokens,
               draft=draft, progress=False, planner=planner_for(method, args, "local"))


def record_drafts(loaded, prompts, args) -> dict:
    """The draft's proposals for every prompt the clients will decode (each client's `--rounds`), alone."""
    from specbench.decode.replay_drafter import record
    from specbench.decode.drafters import ModelDrafter
    from specbench.decode.target import LocalTarget

    share = prompt_share(prompts, args)
    chosen = [prompt for i in range(max(args.clients)) for _, prompt in client_prompts(prompts, share, i, args.rounds)]
    drafter = ModelDrafter(_reference_model(draft_spec(args)), loaded.vocab_size)
    return record(LocalTarget(loaded), drafter, chosen, args.k, args.max_new_tokens)


@functools.lru_cache(maxsize=2)
def _reference_model(spec: ModelSpec):
    return load_model(spec)


def near_tie(spec: ModelSpec, prompt: list[int], got: list[int], alone: list[int]) -> dict:
    """Where two greedy outputs part, the target's logits of both tokens there (`specbench.decode.divergence`)."""
    return asdict(divergence(_reference_model(spec).model, prompt, alone, got))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(TARGETS), default="smollm2")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["target-only", "prompt-lookup"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft", default=None, help="a draft model for `chain` (run by every client process)")
    parser.add_argument("--draft-quant", default="none", help="its quantization, e.g. int8-dynamic")
    parser.add_argument("--dataset", default="mt-bench", help="one prompt per client from this prompt set")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=1,
                        help="prompts each client decodes back to back (its own, distinct ones): with more, a "
                             "client that finishes early starts its next prompt, so batches stay fuller, as "
                             "under steady load, and only the last round leaves a part-full tail")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of steady load: every client decodes prompt after prompt for this long and "
                             "the aggregate counts the tokens of the steps inside the window (all clients busy "
                             "throughout), instead of a fixed number of prompts per client and its tail")
    parser.add_argument("--kernels", default="default", choices=["default", "onednn"],
                        help="the target's linear kernels, in the worker and in the alone runs compared with")
    parser.add_argument("--dtype", default="float32",
                        help="the target's dtype, worker and alone runs (bfloat16 pays on CPUs with avx512_bf16)")
    parser.add_argument("--batch-window-ms", type=float, default=None,
                        help="the batching worker's wait for the other active sessions' steps (default: the worker's)")
    parser.add_argument("--workers", nargs="+", choices=WORKERS, default=["batched", "unbatched"],
                        help="the workers compared, back to back per row: eager batched / one at a time, and the "
                             "same with the fast path (`specbench worker --fast`); batched-wait: a batched worker "
                             "waiting up to --batch-wait-ms for drafting clients expected back")
    parser.add_argument("--batch-wait-ms", default="0", help="the batched-wait worker's (default 0: the fixed window "
                        "only, against the default worker's auto: waits at most a forward's fitted fixed cost)")
    parser.add_argument("--fast-backend", default="compile", help="the fast workers' backend")
    parser.add_argument("--draft-replay", action="store_true",
                        help="clients on other hosts, emulated: the --draft runs alone here first and each client "
                             "replays its proposals, sleeping the seconds each took (decode/replay_drafter.py), so the "
                             "clients take no cores or memory from the worker; with --duration, each client "
                             "cycles through its --rounds prompts (the ones recorded)")
    parser.add_argument("--one-worker", action="store_true",
                        help="keep one worker alive at a time (restarted at each switch): room for client drafts")
    parser.add_argument("--save-measured", action="store_true",
                        help="keep the batched worker's SD speedups over target-only in reference/ (per method "
                             "and client count), which notebook 03 draws beside the predicted ones")
    parser.add_argument("--save-measured-from", metavar="JSON", default=None,
                        help="measure nothing: save the speedups of an earlier run's JSON (as --save-measured)")
    parser.add_argument("--out", default=str(ROOT / "results" / "concurrency.json"))
    args = parser.parse_args()
    if args.save_measured_from:
        report = json.loads(Path(args.save_measured_from).read_text())
        earlier = argparse.Namespace(**{**vars(parser.parse_args([])), **report["settings"]})
        return save_measured(pd.DataFrame(report["rows"]), report["target"], earlier)
    if args.draft_replay and (not args.draft or "chain+planner" in args.methods):
        parser.error("--draft-replay replays a --draft's chains of the run's K: needs --draft, and no chain+planner")
    name = TARGETS[args.pair]
    loaded_spec = target_spec(args)
    loaded = load_model(loaded_spec)
    texts = [row["prompt"] for row in load_prompts(args.dataset, limit=None if args.duration else
                                                   max(args.clients) * args.rounds)]
    prompts = encode_prompts(texts, loaded.tokenizer)
    # alone, in this process: every client's first prompt (the prediction replays these); the other
    # prompts a run decodes are run alone after it, to compare outputs
    firsts = [i * prompt_share(prompts, args) for i in range(max(args.clients))]
    alone_records = {method: decode_alone(loaded, [prompts[i] for i in firsts], method, args)
                     for method in args.methods}
    alone = {(method, index): outputs(records)[(method, i)] for method, records in alone_records.items()
             for i, index in enumerate(firsts)}
    proposals = record_drafts(loaded, prompts, args) if args.draft_replay else None
    if proposals:  # how long the clients draft between steps: what a batch waits for
        draft_s = np.percentile([found[2] for found in proposals.values()], [10, 50, 90]) * 1000
        print(f"recorded draft proposals: {len(proposals)}, ms p10 / p50 / p90: "
              + " / ".join(f"{ms:.0f}" for ms in draft_s))
    target_bytes = loaded.weight_bytes
    del loaded  # the worker loads its own copy: two 1.5B fp32 models and eight clients crowd 24 GiB
    _reference_model.cache_clear()  # (the alone runs' draft too: reloaded after, if needed)
    gc.collect()
    check_memory(target_bytes, 1 if args.one_worker else len(args.workers), max(args.clients), args)
    rows, mismatches, decoded = [], [], []
    workers = Workers(loaded_spec, args.one_worker, args.batch_window_ms, args.fast_backend, args.batch_wait_ms)
    try:
        with multiprocessing.get_context("spawn").Pool(max(args.clients), initializer=load_client_draft,
                                                       initargs=(draft_spec(args), proposals)) as pool:
            warm = lambda endpoint, clients: measure(pool, endpoint, prompts, args.methods[0], clients, args,  # noqa: E731
                                                     steady=False)
            round_trip_s, packed = loopback_round_trip(workers.endpoint("batched", warm))
            # warm-up, discarded: every pool process and worker. A fast worker compiles a graph per batch x
            # step x width shape, so it decodes every prompt it will meet at every client count, twice
            # (batches form differently each time); `new_shapes` shows what was still met while measured
            for kind in args.workers:
                fast = kind.startswith("fast-")
                for clients in (args.clients * 2 if fast else args.clients[-1:]):
                    for method in (args.methods if fast else args.methods[:1]):
                        measure(pool, workers.endpoint(kind, warm), prompts, method, clients, args, steady=False,
                                count=prompt_share(prompts, args) if fast else None)
            for step, clients in enumerate(args.clients):
                for method in args.methods:
                    # the workers back to back, the order alternating, so drift hits them alike
                    for kind in (args.workers if step % 2 == 0 else args.workers[::-1]):
                        row = measure(pool, workers.endpoint(kind, warm), prompts, method, clients, args)
                        decoded.append((kind, clients, method, row.pop("outputs")))
                        rows.append({"worker": kind, "batching": not kind.endswith("unbatched"), **row})
                        print(rows[-1], flush=True)
    finally:
        workers.stop()
    for method in args.methods:  # the prompts the runs decoded that were not decoded alone yet: one run each method
        missing = sorted({index for _, _, m, produced in decoded if m == method for index, _ in produced
                          if (method, index) not in alone})
        if missing:
            produced = outputs(decode_alone(_reference_model(loaded_spec), [prompts[i] for i in missing], method, args))
            alone.update({(method, index): produced[(method, i)] for i, index in enumerate(missing)})
    for kind, clients, method, produced in decoded:  # every greedy output against the prompt alone
        for index, output in produced:
            if output != alone[(method, index)]:
                mismatches.append({"worker": kind, "clients": clients, "method": method, "prompt": index,
                                   **near_tie(loaded_spec, prompts[index], output, alone[(method, index)])})
    table = pd.DataFrame(rows)
    table["order"] = table["worker"].map(WORKERS.index)
    table = table.sort_values(["order", "clients", "method"], ascending=[True, True, False]).drop(columns="order")
    rate = table.set_index(["worker", "clients", "method"])["aggregate_tokens_per_s"]
    for base in ("unbatched", "batched"):  # every worker against the eager one-at-a-time and batched ones
        if base in args.workers:
            table[f"vs_{base}"] = [row.aggregate_tokens_per_s / rate[(base, row.clients, row.method)]
                                   for row in table.itertuples()]
    load = f"steady load for {args.duration:g} s" if args.duration else f"{args.rounds} prompt(s) per client"
    print(f"\n== {loaded_spec.label} worker on loopback, {args.dtype}, {args.max_new_tokens} tokens per prompt, {load}, "
          f"K={args.k} ==")
    print(table.round(3).to_string(index=False))
    print(f"greedy outputs differing from the same prompt alone: {len(mismatches)}", mismatches or "")
    speedups = speedup_table(table, loaded_spec.label, alone_records, [len(prompts[i]) for i in firsts],
                             round_trip_s, packed, args)
    if speedups is not None:
        print("\n== SD speedup over target-only per client, batching on: predicted vs measured ==")
        print(speedups.round(3).to_string(index=False))
    if args.save_measured:
        save_measured(table, name, args)
    suffix = (("" if args.dtype == "float32" else f"-{args.dtype}") + ("" if args.rounds == 1 else f"-r{args.rounds}")
              + (f"-steady{args.duration:g}s" if args.duration else "")
              + ("" if args.kernels == "default" else f"-{args.kernels}")
              + (f"-{draft_spec(args).label}" if args.draft else "") + ("-replay" if args.draft_replay else "")
              + ("" if args.workers == ["batched", "unbatched"] else "-" + "-".join(args.workers)))
    write_report(args.out.replace(".json", f"-{args.pair}{suffix}.json"),
                 {"target": name, "rows": table.to_dict("records"), "mismatches": mismatches,
                  "speedups": None if speedups is None else speedups.to_dict("records"),
                  "round_trip_s": round_trip_s, "packed_batches": packed, "settings": vars(args)})


def save_measured(table: pd.DataFrame, target: str, args) -> None:
    """The batched worker's SD speedups over target-only at each client count, one record per draft
    (prompt lookup, or the --draft model), in reference/ (`plan.library.save_concurrency`)."""
    from specbench.plan.library import REFERENCES, save_concurrency  # shipped beside the references

    batched = table[table["worker"] == "batched"].set_index(["clients", "method"])["aggregate_tokens_per_s"]
    if "target-only" not in args.methods:
        raise SystemExit("--save-measured needs target-only among --methods: speedups are over it")
    load = (f"steady {args.duration:g} s" if args.duration else f"{args.rounds} prompt(s) per client") + \
        f", {args.max_new_tokens} tokens" + (", draft replayed" if args.draft_replay else "")
    def series(method: str) -> str:  # as plan.explore.concurrency_frame names its predicted lines
        base = method.removesuffix("+planner")
        return f"{base} K<={args.k} planned" if base != method else f"{base} K={args.k}"

    for draft, methods in (("prompt-lookup", [m for m in args.methods if m.startswith("prompt-lookup")]),
                           (args.draft, [m for m in args.methods if m.startswith("chain")])):
        rows = [{"clients": clients, "series": series(method),
                 "speedup": batched[(clients, method)] / batched[(clients, "target-only")],
                 "tokens_per_s": batched[(clients, method)] / clients,
                 "target_only_tokens_per_s": batched[(clients, "target-only")] / clients}
                for method in methods for clients in args.clients]
        if rows and draft:
            path = save_concurrency(pd.DataFrame(rows), {"target": target, "draft": draft, "device": device_name("cpu"),
                                                         "dtype": args.dtype, "dataset": args.dataset, "k": args.k,
                                                         "load": load, "workers": "batched",
                                                         "draft_quantization": "none" if draft == "prompt-lookup"
                                                         else args.draft_quant}, folder=REFERENCES)
            print(f"measured speedups of {draft} -> {target} saved to {path}")


def loopback_round_trip(endpoint: str) -> tuple[float, bool]:
    """Median seconds of a `health` request (the per-step network time the prediction adds), and
    whether the worker's batches run packed (how the prediction prices them)."""
    from specbench.worker.client import RemoteTarget

    remote = RemoteTarget(endpoint)
    samples = []
    for _ in range(21):
        started = time.perf_counter()
        remote.health()
        samples.append(time.perf_counter() - started)
    packed = bool(remote.info.get("packed_batches"))
    remote.disconnect()
    return float(np.median(samples)), packed


def speedup_table(table: pd.DataFrame, name: str, alone_records: dict, prompt_lengths, round_trip_s, packed, args):
    """Per client count: each SD method's predicted and measured per-client speedup over target-only."""
    if args.rounds > 1:
        print("(no speedup prediction with --rounds: the replay starts every prompt as its own client at once)")
        return None
    profiles = [p for p in load_profiles() if p.model == name and p.device == device_name("cpu")
                and p.dtype == args.dtype and len(p.batches) > 1]
    if not profiles or "target-only" not in args.methods:
        print(f"(no speedup prediction: needs target-only among the methods and a profile of {name} over batch "
              f"sizes in {args.dtype}; record one with `specbench profile --model {acceptance_label(name)} "
              f"--dtype {args.dtype} --batches 1 2 4 8`"
              f"{' --kernels onednn' if name.endswith('+onednn') else ''})")
        return None
    if "batched" not in args.workers:
        return None
    profile, on = profiles[0], table[table["worker"] == "batched"].set_index(["clients", "method"])
    rows = []
    for clients in args.clients:
        def predicted(method):  # steady state: every client always has a step in the batch (and, with
            records = alone_records[method]  # --duration, pays every client's prefills, prompt after prompt)
            return replay_speed(records[records["prompt_index"] < clients], prompt_lengths, profile, clients,
                                round_trip_s, packed, prefills=bool(args.duration))

        def predicted_run(method):  # this run: the clients start together and end at their own last step
            records = alone_records[method]
            return replay_together(records[records["prompt_index"] < clients], prompt_lengths, profile,
                                   round_trip_s, packed)

        base_measured = on.loc[(clients, "target-only"), "aggregate_tokens_per_s"]
        # a planned run chooses its K from the load it meets, which the alone run's steps cannot replay
        for method in (m for m in args.methods if m != "target-only" and not m.endswith("+planner")):
            measured = on.loc[(clients, method), "aggregate_tokens_per_s"] / base_measured
            steady = predicted(method) / predicted("target-only")
            together = predicted_run(method) / predicted_run("target-only")
            rows.append({"clients": clients, "method": method, "measured_speedup": measured,
                         "predicted_run": together, "error_run": together / measured - 1,
                         "predicted_steady": steady, "error_steady": steady / measured - 1,
                         "predicted_target_only_tok_s": predicted_run("target-only"),
                         "predicted_steady_target_only_tok_s": clients * predicted("target-only"),
                         "measured_target_only_tok_s": base_measured})
    return pd.DataFrame(rows)


if __name__ == "__main__":
    main()
