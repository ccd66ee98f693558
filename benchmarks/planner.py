"""Per-step planning (AutoDraft-style) vs every fixed chain length, local and remote, one run side by side.

The planner is built from the shipped caches only (profiles/ and reference/), then chooses K per
step from live acceptance and RTT. Fixed chains K=1..6 and target-only run on the same prompts;
outputs must all equal target-only (greedy). Prints a table and writes results/planner.json.

    python benchmarks/planner.py [--pair smollm2|qwen] [--rtt 50] [--prompts 4] [--max-new-tokens 32]
                                 [--with-local-planner]

--with-local-planner also runs, remote, the planner `specbench run --worker --plan` built before it planned as
remote (where='local': no network time priced, none learned); `run` refuses that planner beside a worker now,
so the check is lifted for that one configuration.
"""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pandas as pd

from specbench.api import outputs, run
from specbench.decode.metrics import acceptance_rate, tokens_per_second, tokens_per_step
from specbench.models.loading import load_model
from specbench.models.self_draft import truncated_view
from specbench.models.spec import ModelSpec
from specbench.plan.step_planner import planner_from_caches
from specbench.worker.client import NetworkEmulation, RemoteTarget
from specbench.worker.launch import free_port, spawn_worker

from common import bench_prompts, write_report

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {"smollm2": ("smollm2-135m", "smollm2-135m[:26]"), "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}


def measure(target, draft, texts, configs, args, tokenizer, where):
    rows, reference = [], None
    for name, method, k, planner in configs:
        records = run(target, texts, method=method, draft=draft, k=k, max_new_tokens=args.max_new_tokens,
                      progress=False, tokenizer=tokenizer, planner=planner)
        produced = outputs(records)
        key = records["method"].iloc[0]
        if method == "target-only":
            reference = produced
        rows.append({"where": where, "config": name, "tokens_per_s": tokens_per_second(records),
                     "tokens_per_step": tokens_per_step(records), "acceptance_rate": acceptance_rate(records),
                     "mean_k": float(records["step_k"].mean()),
                     "k_histogram": records["step_k"].value_counts().sort_index().to_dict(),
                     "identical_to_target_only": all(produced[(key, i)] == reference[("target-only", i)]
                                                     for i in range(len(texts)))})
        print(f"  {where:>7s} {name:24s} tps={rows[-1]['tokens_per_s']:.2f} mean K={rows[-1]['mean_k']:.2f}", flush=True)
    return rows


def configs_for(planner, ks=(1, 2, 3, 4, 6), local_planner=None):
    return ([("target-only", "target-only", 1, None)] + [(f"chain K={k}", "chain", k, None) for k in ks]
            + [("chain + step planner", "chain", planner.max_k, planner)]
            + ([("chain + local planner", "chain", local_planner.max_k, local_planner)] if local_planner else []))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--rtt", type=float, default=50.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cs", type=float, default=0.0)
    parser.add_argument("--dataset", default="bench", help="which cached reference to plan from")
    parser.add_argument("--out", default=str(ROOT / "results" / "planner.json"))
    parser.add_argument("--with-local-planner", action="store_true",
                        help="remote, also the planner built as for a target here (where='local')")
    args = parser.parse_args()
    target_name, draft_name = PAIRS[args.pair]
    target_spec = ModelSpec(target_name, dtype="float32")  # the shipped profiles are fp32
    target = load_model(target_spec)
    draft = truncated_view(target, 26) if args.pair == "smollm2" else load_model(ModelSpec(draft_name, dtype="float32"))
    texts = bench_prompts(args.prompts)
    cached = dict(dataset=args.dataset, cs=args.cs, dtype="float32")  # the runs' dtype (else a GPU's bf16 profile)
    local_planner = planner_from_caches(target_name, draft_name, **cached)
    print(f"== local ({args.pair}, fp32; planner from {local_planner.target.device}) ==", flush=True)
    rows = measure(target, draft, texts, configs_for(local_planner), args, target.tokenizer, "local")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(endpoint, "--model", target_name, "--dtype", "float32")
    try:
        remote = RemoteTarget(endpoint, network=NetworkEmulation(rtt_ms=args.rtt, jitter_ms=args.rtt / 10))
        remote_planner = planner_from_caches(target_name, draft_name, **cached,
                                             where="remote", rtt_ms=args.rtt)
        print(f"== remote, emulated RTT {args.rtt:g} ms ==", flush=True)
        as_before = (planner_from_caches(target_name, draft_name, **cached)
                     if args.with_local_planner else None)
        with mock.patch("specbench.api.check_runnable", lambda *a: None) if as_before else nullcontext():
            rows += measure(remote, draft, texts, configs_for(remote_planner, ks=(1, 2, 4, 6), local_planner=as_before),
                            args, target.tokenizer, f"rtt{args.rtt:g}")
    finally:
        worker.terminate()
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 220)
    print(table.drop(columns=["k_histogram"]).round(3).to_string(index=False))
    summary = {}
    for where, group in table.groupby("where", sort=False):
        fixed = group[group.config.str.startswith("chain K=")]
        planned = group[group.config == "chain + step planner"].tokens_per_s.iloc[0]
        baseline = group[group.config == "target-only"].tokens_per_s.iloc[0]
        before = group[group.config == "chain + local planner"].tokens_per_s
        summary[where] = {"planner_over_best_fixed_k": planned / fixed.tokens_per_s.max(),
                          **({"planner_over_local_planner": planned / before.iloc[0]} if len(before) else {}),
                          "planner_over_worst_fixed_k": planned / fixed.tokens_per_s.min(),
                          "planner_over_target_only": planned / baseline,
                          "best_fixed": fixed.loc[fixed.tokens_per_s.idxmax()].config}
    print(json.dumps(summary, indent=1))
    write_report(args.out, {"pair": args.pair, "settings": vars(args), "rows": rows, "summary": summary,
                            "note": "RTT is emulated on the client"})


if __name__ == "__main__":
    main()
