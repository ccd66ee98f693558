"""Chains vs fixed and dynamic token trees, local and remote (emulated RTT), one run side by side.

For each pair: tokens_per_step, tokens/s, acceptance and bytes per step for chain K=4, a fixed
tree and dynamic trees at several node budgets; then remote at an EMULATED RTT (default 50 ms):
best chain vs best dynamic tree, and the chain with and without proactive drafting. Greedy.
Prints tables and writes results/trees.json.

    python benchmarks/trees.py [--pair smollm2|qwen] [--budgets 8 16 32 64 128] [--rtt 50]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from specbench.api import TreeShape, outputs, run
from specbench.decode.metrics import acceptance_rate, tokens_per_second, tokens_per_step
from specbench.models.loading import load_model
from specbench.models.self_draft import truncated_view
from specbench.models.spec import ModelSpec
from specbench.worker.client import NetworkEmulation, RemoteTarget
from specbench.worker.launch import free_port, spawn_worker

from common import bench_prompts, write_report

ROOT = Path(__file__).resolve().parents[1]


def measure(target, draft, texts, configs, max_new_tokens, tokenizer, label):
    rows, reference = [], None
    for name, method, k, shape, proactive in configs:
        records = run(target, texts, method=method, draft=draft, k=k, tree=shape, max_new_tokens=max_new_tokens,
                      progress=False, tokenizer=tokenizer, proactive=proactive)
        produced = outputs(records)
        if method == "target-only":
            reference = produced
        identical = reference is not None and all(
            produced[(method, i)] == reference[("target-only", i)] for i in range(len(texts)))
        rows.append({"where": label, "config": name, "tokens_per_step": tokens_per_step(records),
                     "tokens_per_s": tokens_per_second(records), "acceptance_rate": acceptance_rate(records),
                     "nodes_per_step": float(records["drafted"].mean()),
                     "bytes_up_per_step": float(records["bytes_up"].mean()),
                     "target_calls": len(records), "identical_to_target_only": identical,
                     "lookahead_reused": int(records["lookahead_reused"].sum()),
                     "lookahead_discarded": int(records["lookahead_discarded"].sum())})
        print(f"  {label:>7s} {name:28s} tps={rows[-1]['tokens_per_s']:.2f} tokens/step={rows[-1]['tokens_per_step']:.2f}",
              flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=["smollm2", "qwen"], default="smollm2")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--rtt", type=float, default=50.0)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=str(ROOT / "results" / "trees.json"))
    args = parser.parse_args()
    if args.pair == "smollm2":
        target_spec = ModelSpec("smollm2-135m", dtype=args.dtype)
        target = load_model(target_spec)
        draft = truncated_view(target, 26)
    else:
        target_spec = ModelSpec("qwen2.5-coder-1.5b", dtype=args.dtype)
        target = load_model(target_spec)
        draft = load_model(ModelSpec("qwen2.5-coder-0.5b", dtype=args.dtype))
    texts = bench_prompts(args.prompts)
    configs = [("target-only", "target-only", 1, TreeShape(), False), ("chain K=2", "chain", 2, TreeShape(), False),
               ("chain K=4", "chain", 4, TreeShape(), False), ("chain K=6", "chain", 6, TreeShape(), False),
               ("fixed tree (4,2,2,1)", "fixed-tree", 64, TreeShape(widths=(4, 2, 2, 1)), False)]
    configs += [(f"dynamic tree budget={b}", "tree", b, TreeShape(max_depth=8, beam=min(8, b), branch=8), False)
                for b in args.budgets]
    smallest = min(args.budgets)  # the same trees without level pruning (it cuts most at small budgets)
    configs += [(f"unpruned dynamic tree budget={smallest}", "tree", smallest,
                 TreeShape(max_depth=8, beam=min(8, smallest), branch=8, prune=False), False)]
    print(f"== local ({args.pair}, {args.dtype}) ==", flush=True)
    rows = measure(target, draft, texts, configs, args.max_new_tokens, target.tokenizer, "local")
    local = pd.DataFrame(rows)
    trees = local[local.config.str.startswith("dynamic")]
    best_tree = trees.loc[trees.tokens_per_s.idxmax()]
    best_budget = int(best_tree.config.split("=")[1])

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(endpoint, "--model", target_spec.model, "--dtype", args.dtype)
    try:
        remote = RemoteTarget(endpoint, network=NetworkEmulation(rtt_ms=args.rtt, jitter_ms=args.rtt / 10))
        chains = local[local.config.str.startswith("chain")]
        best_chain = chains.loc[chains.tokens_per_s.idxmax()].config
        remote_chains = [c for c in configs if c[0] in {best_chain, "chain K=4"}]
        remote_configs = [configs[0], *remote_chains, ("chain K=4 proactive", "chain", 4, TreeShape(), True),
                          (f"dynamic tree budget={best_budget}", "tree", best_budget,
                           TreeShape(max_depth=8, beam=min(8, best_budget), branch=8), False)]
        print(f"== remote, emulated RTT {args.rtt} ms ==", flush=True)
        rows += measure(remote, draft, texts, remote_configs, args.max_new_tokens, target.tokenizer,
                        f"rtt{args.rtt:g}")
    finally:
        worker.terminate()
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 220)
    print(table.round(3).to_string(index=False))
    chain_local = table[(table["where"] == "local") & table.config.str.startswith("chain")]
    remote_rows = table[table["where"] != "local"]
    chain_remote = remote_rows[remote_rows.config.str.startswith("chain")].tokens_per_s.max()
    tree_remote = remote_rows[remote_rows.config.str.startswith("dynamic")].tokens_per_s.max()
    goals = {"tree_tokens_per_step_over_best_chain": float(trees.tokens_per_step.max() / chain_local.tokens_per_step.max()),
             "remote_tree_tps_over_best_chain": float(tree_remote / chain_remote),
             "pruning_speedup_at_smallest_budget": float(
                 local[local.config == f"dynamic tree budget={smallest}"].tokens_per_s.iloc[0]
                 / local[local.config == f"unpruned dynamic tree budget={smallest}"].tokens_per_s.iloc[0]),
             "proactive_over_plain_chain_remote": float(
                 remote_rows[remote_rows.config == "chain K=4 proactive"].tokens_per_s.iloc[0]
                 / remote_rows[remote_rows.config == "chain K=4"].tokens_per_s.iloc[0])}
    print(json.dumps(goals, indent=1))
    write_report(args.out, {"pair": args.pair, "settings": vars(args), "rows": rows, "goals": goals,
                            "note": "RTT is emulated on the client"})


if __name__ == "__main__":
    main()
