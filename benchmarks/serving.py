"""Load test of `specbench serve` over HTTP: what a user of the endpoint feels at a request rate.

Poisson arrivals at each rate, prompts from a specbench dataset or a JSONL file, every request
streamed; per request the time to first token (TTFT), time per output token after it (TPOT), the
gaps between streamed chunks (ITL: one chunk may carry several tokens when drafts are accepted) and
end-to-end latency; per method and rate their p50/p90/p99, goodput (requests per second meeting
the SLO on TTFT and TPOT) and SD acceptance. Methods run side by side at each rate, in one run; those whose
drafts read earlier outputs (suffix decoding, auto) each on a server of its own, so none recalls the prompts'
outputs another method left in a shared cache.
Then the HTTP layer's own cost: the same request through the server and straight through its
engine, alternated, p50 of the difference.

    python benchmarks/serving.py                                  # starts a server on SmolLM2-135M
    python benchmarks/serving.py --methods target-only prompt-lookup:6 --rates 0.5 1 2 --requests 16
    python benchmarks/serving.py --spawn-worker                   # the target in a separate worker process
    python benchmarks/serving.py --url http://127.0.0.1:8000      # a server already running (no overhead row)
    python benchmarks/serving.py --methods target-only auto --router router.json --prompts agentic  # routed
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from collections import Counter

import httpx
import numpy as np
import pandas as pd

from specbench.datasets import load_prompts
from specbench.worker.launch import free_port, spawn_worker

from common import RESULTS, write_report


def parse_method(text: str) -> tuple[str, int | None]:
    name, _, k = text.partition(":")
    return name, int(k) if k else None


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, method: str, k, max_tokens: int,
                      headers: dict) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "speculative": {"method": method, **({"k": k} if k else {})}}
    started, chunks, usage = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return {"ok": False, "status": response.status_code, "error": response.text[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                return {"ok": False, "status": 200, "error": chunk["error"]["message"][:200]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                chunks.append(time.perf_counter() - started)
    e2e = time.perf_counter() - started
    tokens = usage["completion_tokens"]
    speculative = usage["speculative"]
    return {"ok": True, "status": 200, "ttft_s": chunks[0] if chunks else e2e, "e2e_s": e2e, "tokens": tokens,
            "tpot_s": (e2e - chunks[0]) / (tokens - 1) if chunks and tokens > 1 else None,
            "itl_s": list(np.diff(chunks)), "drafted": speculative["drafted_tokens"],
            "accepted": speculative["accepted_tokens"], "steps": speculative["steps"],
            "chosen": speculative.get("chosen")}


async def run_rate(url: str, model: str, prompts: list[str], method: str, k, rate: float, max_tokens: int,
                   seed: int, headers: dict) -> tuple[list[dict], float]:
    """Every prompt once, arriving as a Poisson process of `rate` per second; returns rows and the span."""
    arrivals = random.Random(seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        started, tasks, at = time.perf_counter(), [], 0.0
        for prompt in prompts:
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, method, k, max_tokens, headers)))
            at += arrivals.expovariate(rate)
        rows = await asyncio.gather(*tasks)
    return list(rows), time.perf_counter() - started


def summarize(rows: list[dict], span_s: float, slo_ttft: float, slo_tpot: float) -> dict:
    done = [r for r in rows if r["ok"]]
    pct = lambda values, q: round(float(np.percentile(values, q)), 4) if values else None  # noqa: E731
    ttft, e2e = [r["ttft_s"] for r in done], [r["e2e_s"] for r in done]
    tpot = [r["tpot_s"] for r in done if r["tpot_s"] is not None]
    itl = [gap for r in done for gap in r["itl_s"]]
    good = [r for r in done if r["ttft_s"] <= slo_ttft and (r["tpot_s"] or 0) <= slo_tpot]
    drafted, accepted = sum(r["drafted"] for r in done), sum(r["accepted"] for r in done)
    return {"completed": len(done), "failed": len(rows) - len(done), "span_s": round(span_s, 2),
            "request_per_s": round(len(done) / span_s, 3), "output_tokens_per_s": round(sum(r["tokens"] for r in done)
                                                                                      / span_s, 2),
            "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p90": pct(tpot, 90), "tpot_p99": pct(tpot, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90), "e2e_p99": pct(e2e, 99),
            "goodput_req_per_s": round(len(good) / span_s, 3),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_step": round(sum(r["tokens"] for r in done) / max(1, sum(r["steps"] for r in done)), 3),
            "chosen": dict(sorted(Counter(r["chosen"] for r in done if r["chosen"]).items())) or None}


def http_overhead(engine, url: str, model: str, prompt_ids: list[int], repeats: int, max_tokens: int) -> dict:
    """The same request (token ids in, `max_tokens` out, target-only) through HTTP and straight through
    the server's engine, alternated; the HTTP layer's cost is the difference."""
    from specbench.serve.engine import Job
    from specbench.serve.settings import Speculation

    job = Job(prompt_ids, max_tokens, Speculation("target-only", 1))
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "speculative": {"method": "target-only"}}
    direct, through, differences = [], [], []
    with httpx.Client(timeout=120) as client:
        client.post(f"{url}/v1/completions", json=body)  # warm
        for _ in range(repeats):
            started = time.perf_counter()
            list(engine.stream(job, threading.Event()))
            direct.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert client.post(f"{url}/v1/completions", json=body).status_code == 200
            through.append(time.perf_counter() - started)
            differences.append(through[-1] - direct[-1])
    return {"repeats": repeats, "prompt_tokens": len(prompt_ids), "max_tokens": max_tokens,
            "direct_p50_ms": round(1000 * statistics.median(direct), 2),
            "http_p50_ms": round(1000 * statistics.median(through), 2),
            "overhead_p50_ms": round(1000 * statistics.median(differences), 2),
            "overhead_p90_ms": round(1000 * float(np.percentile(differences, 90)), 2),
            "overhead_mean_ms": round(1000 * statistics.mean(differences), 2),
            "difference_of_p50s_ms": round(1000 * (statistics.median(through) - statistics.median(direct)), 2)}


def start_server(args, methods, endpoint=None, cache: str = ""):
    """A server offering `methods` (on the worker at `endpoint`, else one in its own process), its suffix decoding
    cache named `cache`: servers in one process keep their caches apart only by name."""
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.serve import Limits, ServeSettings
    from specbench.serve.background import BackgroundServer

    k = max([k for _, k in methods if k] or [4])
    settings = ServeSettings(target=args.target, methods=tuple(dict.fromkeys(m for m, _ in methods)),
                             draft=args.draft, k=k, max_k=max(8, k), worker=endpoint, router=args.router,
                             port=free_port(), limits=Limits(max_tokens=max(args.max_tokens, 16),
                                                             max_concurrent=args.max_concurrent, max_queue=256),
                             suffix=SuffixSettings(name=cache))
    return BackgroundServer(settings)


def keeps_outputs(method: str) -> bool:
    from specbench.methods import get_method
    from specbench.serve.settings import AUTO

    return method == AUTO or get_method(method).keeps_outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", help="draft model for chain/tree methods")
    parser.add_argument("--methods", nargs="+", default=["target-only", "prompt-lookup:6"],
                        help="method[:K] each; compared side by side at every rate")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="requests per second")
    parser.add_argument("--prompts", default="humaneval", help="a dataset name or a JSONL path")
    parser.add_argument("--requests", type=int, default=16, help="requests per method and rate")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-concurrent", type=int, default=8)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds per output token")
    parser.add_argument("--router", help="a router file (`specbench route`): the method auto routes each request")
    parser.add_argument("--spawn-worker", action="store_true", help="the target in a separate worker process")
    parser.add_argument("--url", help="a running server (its model must be --target)")
    parser.add_argument("--only-overhead", action="store_true", help="skip the load test")
    parser.add_argument("--api-key")
    parser.add_argument("--overhead-repeats", type=int, default=100)
    parser.add_argument("--overhead-prompt-tokens", type=int, default=8,
                        help="a short prompt and one output token: the compute beside the HTTP layer stays small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "serving.json"))
    args = parser.parse_args()

    methods = [parse_method(m) for m in args.methods]
    prompts = [row["prompt"] for row in load_prompts(args.prompts, args.requests, seed=args.seed)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    servers, worker, endpoint = [], None, None
    urls = {label: args.url for label in args.methods}
    if args.url is None and args.spawn_worker:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        worker = spawn_worker(endpoint, "--model", args.target)
    rows, overhead = [], None
    try:
        if args.url is None:
            # methods whose drafts read earlier outputs (suffix decoding's cache, auto's) each get a server with a
            # cache of its own: in one cache, each method after the first would recall the same prompts'
            # outputs from the methods before it (a second run of a prompt drafts nearly all of it)
            labelled = list(zip(args.methods, methods))
            apart = [(label, method) for label, method in labelled if keeps_outputs(method[0])]
            together = [(label, method) for label, method in labelled if not keeps_outputs(method[0])]
            if together:
                servers.append(start_server(args, [method for _, method in together], endpoint))
                urls.update({label: servers[-1].url for label, _ in together})
            for label, method in apart:
                servers.append(start_server(args, [method], endpoint, cache=f"serving-{label}"))
                urls[label] = servers[-1].url
        server = next((one for one in servers if "target-only" in one.engine.settings.methods), None)
        url = server.url if server else args.url
        for rate in ([] if args.only_overhead else args.rates):
            for label, (method, k) in zip(args.methods, methods):  # side by side at each rate
                requests, span = asyncio.run(run_rate(urls[label], args.target, prompts, method, k, rate,
                                                      args.max_tokens, args.seed, headers))
                failed = [r for r in requests if not r["ok"]]
                if failed:
                    print(f"  {len(failed)} failed, e.g. {failed[0]}")
                row = {"method": method if k is None else f"{method}:{k}", "rate": rate,
                       **summarize(requests, span, args.slo_ttft, args.slo_tpot)}
                rows.append(row)
                print({key: row[key] for key in ("method", "rate", "completed", "ttft_p50", "tpot_p50", "e2e_p50",
                                                 "goodput_req_per_s", "acceptance", "chosen")}, flush=True)
        if server is not None and args.overhead_repeats:
            ids = server.engine.tokenizer(prompts[0])["input_ids"][:args.overhead_prompt_tokens]
            overhead = http_overhead(server.engine, url, args.target, ids, args.overhead_repeats, max_tokens=1)
            print("HTTP overhead:", overhead)
    finally:
        for one in servers:
            one.close()
        if worker is not None:
            worker.terminate()
            worker.wait(30)
    columns = ["method", "rate", "completed", "failed", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50",
               "e2e_p50", "e2e_p99", "output_tokens_per_s", "goodput_req_per_s", "acceptance", "tokens_per_step"]
    if rows:
        print(pd.DataFrame(rows)[columns].to_string(index=False))
    write_report(args.out, {"command": "benchmarks/serving.py", "args": vars(args), "servers": len(servers) or None,
                            "where": "separate worker process" if args.spawn_worker else
                            ("url" if args.url else "worker in the server's process"),
                            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
                            "rows": rows, "http_overhead": overhead})


if __name__ == "__main__":
    main()
