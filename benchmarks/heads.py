"""A trained draft head against prompt lookup and the target's other drafts, on prompts it never saw.

Why: a head is only worth training if it beats what needs no training. One run, side by side per K
(every method of a K in one `run` call, so they share the machine's moment): tokens per step,
acceptance per position, the draft's cost per drafted token as a fraction of a target forward, and
tokens/s against target-only, on MT-bench and HumanEval slices (the head trains on ShareGPT).

    python benchmarks/heads.py --train-minutes 30           # train (or resume) the head, then compare
    python benchmarks/heads.py --head results/heads/smollm2-135m/head
"""
from __future__ import annotations

import argparse
import time

import pandas as pd

from specbench.api import run
from specbench.datasets import load_prompts
from specbench.decode.metrics import per_position_acceptance, summarize
from specbench.decode.target import LocalTarget
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec

from common import RESULTS, write_report


def trained(args) -> tuple[str, dict]:
    """The head's folder, training it first (resuming) when asked; what training reported."""
    from specbench.heads.train import TrainSpec, train_head

    if not args.train_minutes:
        return args.head, {}
    spec = TrainSpec(target=args.target, prompts="sharegpt", prompt_count=args.train_prompts, held_out=4,
                     minutes=args.train_minutes, epochs=args.epochs, draft_vocab=args.draft_vocab, max_new_tokens=64,
                     max_length=192)
    started = time.perf_counter()
    result = train_head(spec, args.train_dir)
    last = result.history.dropna(subset=["held_out_tokens_per_step"]) if "held_out_tokens_per_step" in \
        result.history else pd.DataFrame()
    return str(result.folder / "head"), {
        "seconds": round(time.perf_counter() - started, 1), "phases": result.seconds, **result.data,
        "final_loss": [float(result.history[c].tail(20).mean()) for c in result.history if c.startswith("loss_")],
        "held_out_tokens_per_step": float(last["held_out_tokens_per_step"].iloc[-1]) if len(last) else None,
        "spec": spec.__dict__}


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
    parser.add_argument("--out", default=str(RESULTS / "heads.json"))
    args = parser.parse_args()

    head, training = trained(args)
    target = LocalTarget(load_model(ModelSpec(args.target)))
    rows, positions = [], []
    for dataset in args.datasets:
        prompts = [row["prompt"] for row in load_prompts(dataset, limit=args.prompt_count, seed=1)]
        for k in args.k:
            methods = (["target-only"] if k == args.k[0] else []) + ["eagle", "eagle-tree", *args.others]
            records = run(target, prompts, method=methods, draft=head, k=k, max_new_tokens=args.max_new_tokens,
                          self_draft_layers=args.self_draft_layers, substitute_quantization="int8-dynamic",
                          progress=f"heads: {dataset}, K={k}")
            table = summarize(records)
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
    table = pd.DataFrame(rows)
    base = table[table["method"] == "target-only"].set_index("dataset")["tokens_per_s"]
    table["speedup_vs_target_only"] = table["tokens_per_s"] / table["dataset"].map(base)
    columns = ["dataset", "method", "k", "tokens_per_step", "acceptance_rate", "draft_cost_per_token", "tokens_per_s",
               "speedup_vs_target_only"]
    print(table[columns].round(3).to_string(index=False))
    print(pd.DataFrame(positions).to_string(index=False))
    write_report(args.out, {"target": args.target, "head": head, "training": training, "rows": table.to_dict("records"),
                            "per_position": positions, "settings": vars(args)})


if __name__ == "__main__":
    main()
