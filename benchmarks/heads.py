"""A trained draft head against prompt lookup and the target's other drafts, on prompts it never saw.

Why: a head is only worth training if it beats what needs no training. One run, side by side per K
(every method of a K in one `run` call, so they share the machine's moment): tokens per step,
acceptance per position, the draft's cost per drafted token as a fraction of a target forward, and
tokens/s against target-only, on MT-bench and HumanEval slices (the head trains on ShareGPT).

    python benchmarks/heads.py --train-minutes 30           # train (or resume) the head, then compare
    python benchmarks/heads.py --head results/heads/smollm2-135m/head
    python benchmarks/heads.py --head ... --placements   # also through a worker, the head on either side
    python benchmarks/heads.py --head ... --tree-nodes 8 16  # also trees as deep as the chain, with more nodes

With `--placements`, the same head drafts through a `specbench worker` on this machine on the client
(the worker sends feature rows) and on the worker (`eagle-server`): measured bytes per step and per
token, and the speed each would have at other RTTs and uplinks (the measured compute, the loopback's
network time replaced by RTT + bytes / bandwidth).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from specbench.api import run
from specbench.datasets import load_prompts
from specbench.decode.metrics import per_position_acceptance, summarize, tokens_per_step_by_position
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.decode.target import LocalTarget
from specbench.methods import TreeShape
from specbench.models.loading import load_model
from specbench.models.spec import KERNELS, KERNELS_HELP, ModelSpec

from common import RESULTS, write_report


def trained(args) -> tuple[str, dict]:
    """The head's folder, training it first (resuming) when asked; what training reported."""
    from specbench.heads.train import TrainSpec, train_head

    if not args.train_minutes:
        return args.head, {}
    spec = TrainSpec(target=args.target, prompts="sharegpt", prompt_count=args.train_prompts, held_out=4,
                     minutes=args.train_minutes, epochs=args.epochs, draft_vocab=args.draft_vocab, max_new_tokens=64,
                     max_length=192, dtype=args.dtype)
    started = time.perf_counter()
    result = train_head(spec, args.train_dir)
    last = result.history.dropna(subset=["held_out_tokens_per_step"]) if "held_out_tokens_per_step" in \
        result.history else pd.DataFrame()
    return str(result.folder / "head"), {
        "seconds": round(time.perf_counter() - started, 1), "phases": result.seconds, **result.data,
        "final_loss": [float(result.history[c].tail(20).mean()) for c in result.history if c.startswith("loss_")],
        "held_out_tokens_per_step": float(last["held_out_tokens_per_step"].iloc[-1]) if len(last) else None,
        "spec": spec.__dict__}


RTTS_MS, UPLINKS_MBPS = (5, 30, 100), (1, 10, 100)


def placements(args, head: str, prompts: list) -> tuple[list[dict], list[dict]]:
    """Both placements through a worker: measured wire bytes, and tok/s priced at other networks."""
    from specbench.models.loading import load_tokenizer
    from specbench.worker.client import RemoteTarget
    from specbench.worker.launch import free_port, spawn_worker

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = spawn_worker(endpoint, "--model", args.target, "--allow-load", head, timeout_s=300)
    try:
        remote = RemoteTarget(endpoint, tokenizer=load_tokenizer(args.target))
        records = run(remote, prompts, method=["target-only", "eagle", "eagle-server"], draft=head, k=4,
                      max_new_tokens=args.max_new_tokens, progress="heads: placements through a worker")
    finally:
        process.terminate()
    measured, priced = [], []
    for method, group in records.groupby("method", sort=False):
        tokens = group["emitted"].sum() if "emitted" in group else group["emitted_tokens"].map(len).sum()
        wire = group["bytes_up"].sum() + group["bytes_down"].sum()
        compute = (group["step_s"] - group["network_s"]).sum()
        trips = group["prompt_index"].nunique() if method == "eagle-server" else len(group)  # round trips made
        measured.append({"method": method, "steps": len(group), "tokens": int(tokens),
                         "tokens_per_step": tokens / len(group), "round_trips": int(trips),
                         "bytes_up_per_step": group["bytes_up"].mean(), "bytes_down_per_step": group["bytes_down"].mean(),
                         "bytes_per_token": wire / tokens, "compute_s": compute,
                         "loopback_tokens_per_s": tokens / group["step_s"].sum()})
        for rtt in RTTS_MS:
            for uplink in UPLINKS_MBPS:  # the same link both ways
                seconds = compute + trips * rtt / 1000 + wire * 8 / (uplink * 1e6)
                priced.append({"method": method, "rtt_ms": rtt, "mbps": uplink, "tokens_per_s": tokens / seconds})
    return measured, priced


def _name(folder: str) -> str:
    """A head's name in the tables: its training folder's (`<out>/head` -> `<out>`'s last part)."""
    path = Path(folder)
    return path.parent.name if path.name == "head" else path.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--head", default=str(RESULTS / "heads" / "smollm2-135m" / "head"))
    parser.add_argument("--train-minutes", type=float, default=0.0, help="train (or resume) first, for this long")
    parser.add_argument("--train-dir", default=str(RESULTS / "heads" / "smollm2-135m"))
    parser.add_argument("--train-prompts", type=int, default=244)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--datasets", nargs="+", default=["mt-bench", "humaneval"])
    parser.add_argument("--prompt-count", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--others", nargs="+", default=["prompt-lookup", "substitute"])
    parser.add_argument("--self-draft-layers", type=int, default=7)
    parser.add_argument("--drafts", nargs="*", default=[],
                        help="draft model folders (e.g. `train-draft --distil`'s <out>/draft) run as chains per K too")
    parser.add_argument("--other-heads", nargs="*", default=[],
                        help="more head folders, each drafting chains and trees on the same prompts right after "
                             "--head's (rows `eagle@NAME`): two trainings compared in one run")
    parser.add_argument("--tree-nodes", type=int, nargs="*", default=[],
                        help="also the head's tree at depth K with this many nodes (EAGLE-2's depth and budget; "
                             "`eagle-tree` itself spends K nodes)")
    parser.add_argument("--placements", action="store_true", help="also through a worker, the head on either side")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="the local comparison per K (--no-compare: placements only)")
    parser.add_argument("--kernels", default="default", choices=list(KERNELS), help=KERNELS_HELP)
    parser.add_argument("--dtype", default="float32", help="the target's, in training and comparing (bfloat16 on a CPU "
                                                         "with AVX-512 bf16: wide verifies nearly cost a 1-token one)")
    parser.add_argument("--position-width", type=int, default=32,
                        help="tokens per step by where in the reply a step began, in bins this wide")
    parser.add_argument("--records", help="also write every step record here (parquet)")
    parser.add_argument("--out", default=str(RESULTS / "heads.json"))
    args = parser.parse_args()

    head, training = trained(args)
    target_spec = ModelSpec(args.target, dtype=args.dtype, kernels=args.kernels)
    target = LocalTarget(load_model(target_spec)) if args.compare else None
    rows, positions, along, kept = [], [], [], []
    for dataset in args.datasets if args.compare else ():
        prompts = [row["prompt"] for row in load_prompts(dataset, limit=args.prompt_count, seed=1)]
        for k in args.k:
            methods = (["target-only"] if k == args.k[0] else []) + ["eagle", "eagle-tree", *args.others]
            # suffix decoding's cache kept to this call: the same prompts run again at every K, and a cache shared
            # across the calls would recall the earlier answers whole (3.7 tokens a step at K=16 after K=8 here)
            records = run(target, prompts, method=methods, draft=head, k=k, max_new_tokens=args.max_new_tokens,
                          self_draft_layers=args.self_draft_layers, substitute_quantization="int8-dynamic",
                          suffix=SuffixSettings(cache="drafter"), progress=f"heads: {dataset}, K={k}")
            for folder in args.drafts:  # right after, on the same prompts
                extra = run(target, prompts, method="chain", draft=folder, k=k, max_new_tokens=args.max_new_tokens,
                            progress=f"heads: {dataset}, K={k}, {folder}")
                extra["method"] = f"chain:{Path(folder).parent.name if Path(folder).name == 'draft' else folder}"
                records = pd.concat([records, extra], ignore_index=True)
            for folder in args.other_heads:  # right after, on the same prompts: another training of a head
                name = _name(folder)
                extra = run(target, prompts, method=["eagle", "eagle-tree"], draft=folder, k=k,
                            max_new_tokens=args.max_new_tokens, progress=f"heads: {dataset}, K={k}, {name}")
                extra["method"] = extra["method"] + f"@{name}"
                records = pd.concat([records, extra], ignore_index=True)
            for nodes in args.tree_nodes:  # EAGLE-2's shape: as deep as the chain, wider than it
                for folder in [head, *args.other_heads]:
                    extra = run(target, prompts, method="eagle-tree", draft=folder, k=nodes,
                                tree=TreeShape(max_depth=k), max_new_tokens=args.max_new_tokens,
                                progress=f"heads: {dataset}, depth {k}, {nodes} nodes")
                    extra["method"] = f"eagle-tree:{nodes}-nodes" + ("" if folder == head else f"@{_name(folder)}")
                    records = pd.concat([records, extra], ignore_index=True)
            table = summarize(records)
            along.append(tokens_per_step_by_position(records, args.position_width).round(3)
                         .reset_index().assign(dataset=dataset, k=k))
            if args.records:
                kept.append(records.assign(dataset=dataset, k_asked=k))
            forward = records.loc[records["method"] != "target-only", "target_forward_s"].mean()
            for row in table.to_dict("records"):
                group = records[records["method"] == row["method"]]
                drafted = group["drafted"].sum()
                rows.append({"dataset": dataset, "k": 0 if row["method"] == "target-only" else k, **row,
                             "draft_cost_per_token": (group["draft_s"].sum() / drafted / forward) if drafted else 0.0})
                if row["method"] != "target-only":
                    rates = per_position_acceptance(group)
                    positions.append({"dataset": dataset, "method": row["method"], "k": k,
                                      **{f"p{j}": round(v, 3) for j, v in rates.items()}})
    table, by_position = pd.DataFrame(rows), pd.concat(along) if along else pd.DataFrame()
    if len(table):
        base = table[table["method"] == "target-only"].set_index("dataset")["tokens_per_s"]
        table["speedup_vs_target_only"] = table["tokens_per_s"] / table["dataset"].map(base)
        columns = ["dataset", "method", "k", "tokens_per_step", "acceptance_rate", "draft_cost_per_token",
                   "tokens_per_s", "speedup_vs_target_only"]
        print(table[columns].round(3).to_string(index=False))
        print(pd.DataFrame(positions).to_string(index=False))
        print(f"tokens per step by where in the reply the step began ({args.position_width}-token bins):")
        print(by_position.to_string(index=False))
    if kept:
        pd.concat(kept, ignore_index=True).to_parquet(args.records)
    measured, priced = [], []
    if args.placements:
        prompts = [row["prompt"] for dataset in args.datasets
                   for row in load_prompts(dataset, limit=max(2, args.prompt_count // 2), seed=1)]
        measured, priced = placements(args, head, prompts)
        print(pd.DataFrame(measured).round(3).to_string(index=False))
        print(pd.DataFrame(priced).pivot_table(index=["rtt_ms", "mbps"], columns="method",
                                               values="tokens_per_s").round(2).to_string())
    write_report(args.out, {"target": args.target, "head": head, "training": training, "rows": table.to_dict("records"),
                            "per_position": positions, "by_reply_position": by_position.to_dict("records"),
                            "placements": measured, "placements_priced": priced, "settings": vars(args)})


if __name__ == "__main__":
    main()
