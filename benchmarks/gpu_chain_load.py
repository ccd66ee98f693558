"""Chain SD against a shared worker under load, measured and predicted (`gpu_worker.py --chain`).

Each of 1..8 client processes decodes its own prompt with chain SD through one `specbench worker`; the
draft is a `TraceDrafter` (replay_draft.py): the target's weights are random, so its acceptance follows
the shipped Qwen2.5-Coder 0.5B -> 1.5B mt-bench reference's accepted lengths, and drafting sleeps
`--draft-ms` per step (the draft runs on the user's device, not here); `--k 0` decodes target-only.
Predicted: the same prompts decoded one at a time through the same worker (their steps: drafted,
accepted, the client's own time), replayed together by `plan.replay.replay_together` with every round's
verify priced on the worker's own batch grid (its `profile` op), the loopback round trip measured alone,
and the worker's own work per round outside the forward (`HostCost`, fitted by the worker on the warm-up
rounds' rows: its `stats`). The prediction without that host term, as notebook 03 made it before, is
printed beside it.
"""
from __future__ import annotations

import multiprocessing
import time
from dataclasses import asdict

import pandas as pd

from specbench.hardware import device_name
from specbench.plan.predict import HostCost
from specbench.plan.replay import replay_together

from common import write_report

PROMPT_SEED = 7


def decode(remote, job: dict):
    from specbench.decode.loop import Decoding, generate

    from replay_draft import TraceDrafter

    if job["k"] == 0:  # target-only: nothing drafted, so nothing hides the worker's own time
        plain = Decoding(0, job["max_new_tokens"], method="target-only", kind="none")
        result = generate(remote, None, job["prompt"], plain, prompt_index=job["index"],
                          session=f"chain-{job['index']}")
        return result, 0
    drafter = TraceDrafter(job["prompt"], job["continuation"], job["accepts"], job["draft_s"], job["vocab"])
    result = generate(remote, drafter, job["prompt"], Decoding(job["k"], job["max_new_tokens"], method="chain"),
                      prompt_index=job["index"], session=f"chain-{job['index']}")
    return result, drafter.misses


def client_job(job: dict) -> dict:
    """One client: its prompt `rounds` times from the shared `go` time; tokens, seconds, misses, outputs."""
    import torch

    from specbench.worker.client import RemoteTarget

    torch.set_num_threads(1)
    remote = RemoteTarget(job["endpoint"], timeout_s=300)
    decode(remote, job)  # this process's first decode (imports, first calls) is not measured
    late = time.perf_counter() > job["go"]
    time.sleep(max(0.0, job["go"] - time.perf_counter()))
    started, emitted, misses, same = time.perf_counter(), 0, 0, True
    for _ in range(job["rounds"]):
        result, missed = decode(remote, job)
        emitted += len(result.output_ids)
        misses += missed
        same &= result.output_ids == job["continuation"]
    return {"tokens": emitted, "seconds": time.perf_counter() - started, "misses": misses, "lossless": same,
            "late": late}


def chain_load(folder: str, args) -> None:
    import torch

    from specbench.api import outputs, run
    from specbench.record import profile_worker
    from specbench.worker.client import RemoteTarget

    from gpu import reference_accepts
    from gpu_worker import serving

    accepts, trace = reference_accepts(400)
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    most = max(args.clients)
    prompts = [torch.randint(2, 512, (args.prompt_tokens,), generator=generator).tolist() for _ in range(most)]
    with serving(folder, "fast" if args.device.startswith("cuda") else "fast-static", args) as endpoint:
        remote = RemoteTarget(endpoint, timeout_s=300)
        vocab, packed = int(remote.info["vocab_size"]), bool(remote.info.get("packed_batches"))
        started = time.perf_counter()
        frame = run(remote, prompts, method="target-only", max_new_tokens=args.max_new_tokens, progress=False,
                    warmup=False)
        continuations = [outputs(frame)[("target-only", i)] for i in range(most)]
        jobs = [{"endpoint": endpoint, "prompt": prompts[i], "continuation": continuations[i], "index": i,
                 "accepts": accepts[7 * i:] + accepts[:7 * i], "draft_s": args.draft_ms / 1000, "vocab": vocab,
                 "k": args.k, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds} for i in range(most)]
        alone, alone_misses = [], 0
        for job in jobs:  # each prompt alone: the steps the prediction replays (and 1-row shapes captured)
            decode(remote, job)
            result, missed = decode(remote, job)
            alone += [dict(asdict(record), prefill_s=result.prefill_s) for record in result.records]
            alone_misses += missed
        alone = pd.DataFrame(alone)
        profile, _ = profile_worker(endpoint, tokens=list(range(1, args.k + 2)),
                                    contexts=[args.prompt_tokens, args.prompt_tokens + args.max_new_tokens],
                                    repeats=5, batches=sorted({1, *args.clients}))
        print(f"alone and profiled in {time.perf_counter() - started:.1f} s; "
              f"network {1000 * alone['network_s'].mean():.2f}"
              f" ms/step, client overhead {1000 * alone['overhead_s'].mean():.2f} ms/step", flush=True)
        # clients fork from one server that imported what a client runs: spawn paid those imports (~6 CPU-s on a
        # 2-core box) once per client process; the server is a fresh interpreter, so no CUDA state is inherited
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["specbench.worker.client", "specbench.decode.loop", "replay_draft"])
        rows = []
        with context.Pool(most) as pool:
            spawned = []

            def measure(clients: int) -> dict:
                # every client warmed up and waiting before any starts (3 s: eight warm-up decodes of a 1.5B
                # target); the CPU rehearsal's tiny decodes need a second once the pool's imports are done
                go = time.perf_counter() + (1.0 if spawned and not args.device.startswith("cuda") else 3.0)
                spawned.append(clients)
                done = pool.map(client_job, [dict(job, go=go) for job in jobs[:clients]], chunksize=1)
                tokens, seconds = sum(d["tokens"] for d in done), max(d["seconds"] for d in done)
                return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                        "misses": sum(d["misses"] for d in done), "lossless": all(d["lossless"] for d in done),
                        "late_starts": sum(d["late"] for d in done)}

            for clients in args.clients:  # warm-up: every batch shape captured, the worker's host line fitted
                measure(clients)
            stats = remote.stats()
            host = HostCost.from_stats(stats)
            print(f"worker host work per round: {1000 * host.fixed_s:.3f} ms + {1000 * host.row_s:.3f} ms per row "
                  f"({stats.get('host_rounds')} rounds)", flush=True)
            lengths = [len(p) for p in prompts]
            network_s = float(alone["network_s"].mean())
            for clients in args.clients:
                measured = measure(clients)
                mine = alone[alone["prompt_index"] < clients]
                predicted = replay_together(mine, lengths, profile, network_s, packed, host.beyond_one(),
                                            alone_verifies=True)
                forwards_only = replay_together(mine, lengths, profile, network_s, packed)
                rows.append({"clients": clients, "measured_tok_s": measured["tok_s"], "predicted_tok_s": predicted,
                             "error": predicted / measured["tok_s"] - 1,
                             "predicted_without_host_tok_s": forwards_only,
                             "error_without_host": forwards_only / measured["tok_s"] - 1,
                             "misses": measured["misses"], "lossless": measured["lossless"],
                             "late_starts": measured["late_starts"]})
                print(pd.DataFrame(rows[-1:]).round(3).to_string(index=False, header=len(rows) == 1), flush=True)
        table = pd.DataFrame(rows)
        accepted = float((alone["emitted"] - 1).mean())
        print(f"\n{device_name(args.device)}, {args.arch} {args.dtype}, "
              f"{f'chain K={args.k}' if args.k else 'target-only'} ({trace}: "
              f"{accepted:.2f} accepted per step alone), draft {args.draft_ms:g} ms/step, aggregate tokens/s:")
        print(table.round(3).to_string(index=False))
        write_report(args.out, {"device": device_name(args.device), "arch": args.arch, "dtype": args.dtype,
                                "trace": trace, "accepted_per_step": accepted, "alone_misses": alone_misses,
                                "host": asdict(host), "stats": stats, "packed": packed,
                                "network_ms": 1000 * network_s, "rows": rows, "args": vars(args)})
