"""Prompt lookup and suffix decoding settings replayed on recorded requests: exact tokens per step, no timing.

Why: under greedy decoding a lookup drafter's proposals depend only on the context and on what it saw
before, and the output is the target's own, so every step's accepted count can be replayed from the
target-only outputs without running the model (as `tune/replay.py` does for chains). Timings on a busy
2-core VM move 10-25% per prompt; tokens per step and verified width do not. Each setting's tok/s is then
priced with one step cost for all (seconds = fixed + per verified token, from the router's fits of the
same workload run), so settings differ only by what they accept and verify. Where a verify of two tokens
costs far more than one (float32 on an AVX2 CPU: 1.7x), `--records` fits the step cost from the run's
calibration records instead, with a surcharge on every step that drafts at all: what suffix decoding's
`min_score` floor saves.

    python benchmarks/workload.py ...            # writes results/workload.calibration.json and the router
    python benchmarks/lookup_replay.py
    python benchmarks/lookup_replay.py --requests results/X.calibration.json --records results/X.calibration-records.pkl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from specbench.decode.drafters import PromptLookupDrafter
from specbench.decode.suffix_drafter import SuffixDrafter, SuffixSettings
from specbench.route.suffix_floor import StepCost, fit_step_cost
from specbench.tune.replay import tree_accepted
from specbench.types import SamplingParams

from common import RESULTS, write_report

MULTI_TURN = ("self-refine", "code-edit", "tool-call", "sharegpt-multiturn")


def replay(requests, make, k: int) -> dict:
    drafter, steps, verified, tokens, drafting = make(), 0, 0, 0, 0
    for request in requests:
        full, position = list(request["ids"]) + list(request["output"]), len(request["ids"])
        while position < len(full):
            budget = min(k, len(full) - position - 1)
            tree = drafter.propose(full[:position], budget, SamplingParams(), torch.Generator(),
                                   max_depth=budget) if budget >= 1 else None
            accepted = tree_accepted(tree, full[position:]) if tree is not None else 0
            steps, verified, position = steps + 1, verified + 1 + (len(tree) if tree else 0), position + accepted + 1
            drafting += bool(tree)
        tokens += len(request["output"])
        if hasattr(drafter, "finish"):
            drafter.finish(full)
    return {"tokens_per_step": tokens / steps, "verified_per_step": verified / steps, "steps": steps, "tokens": tokens,
            "verified": verified, "drafting_steps": drafting}


SETTINGS = {
    "prompt-lookup K=4": (lambda: PromptLookupDrafter(), 4),
    "prompt-lookup K=8": (lambda: PromptLookupDrafter(), 8),
    "suffix (defaults)": (lambda: SuffixDrafter(SuffixSettings(cache="drafter")), 16),
    "suffix, cache off": (lambda: SuffixDrafter(SuffixSettings(cache="off")), 16),
    "suffix factor 2": (lambda: SuffixDrafter(SuffixSettings(cache="drafter", factor=2.0)), 16),
    "suffix factor 2, min_prob 0.3": (lambda: SuffixDrafter(SuffixSettings(cache="drafter", factor=2.0,
                                                                           min_prob=0.3)), 16),
    "suffix-tree (defaults)": (lambda: SuffixDrafter(SuffixSettings(cache="drafter"), tree=True), 16),
    **{f"suffix factor 2 offset 1, min_score {floor}": (
        lambda floor=floor: SuffixDrafter(SuffixSettings(cache="drafter", factor=2.0, offset=1.0, min_score=floor)), 16)
       for floor in (0.0, 1.0, 2.0, 3.0)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default=str(RESULTS / "workload.calibration.json"))
    parser.add_argument("--router", default=str(RESULTS / "workload.router.json"), help="its target-only and prompt "
                        "lookup fits price a step: fixed seconds and seconds per verified token")
    parser.add_argument("--records", help="the workload run's calibration records (.calibration-records.pkl): fit "
                        "the step cost from them, a drafted step's surcharge included, instead of the router's fits")
    parser.add_argument("--out", default=str(RESULTS / "lookup_replay.json"))
    args = parser.parse_args()
    requests = json.loads(Path(args.requests).read_text())
    if args.records:
        cost = fit_step_cost(pd.read_pickle(args.records))
    else:
        fits = json.loads(Path(args.router).read_text())["fits"]
        per_token = fits["prompt-lookup k=4"]["per_token_s"]
        cost = StepCost(fits["target-only"]["fixed_s"] + fits["target-only"]["per_token_s"] - per_token, per_token, 0.0)
    print("step cost: " + ", ".join(f"{name} {value * 1000:.2f} ms" for name, value in vars(cost).items()))
    rows = []
    for scope, members in (("multi-turn", [r for r in requests if r["set"] in MULTI_TURN]), ("all", requests)):
        for name, (make, k) in SETTINGS.items():
            found = replay(members, make, k)
            seconds = cost.seconds(found["steps"], found["verified"], found["drafting_steps"])
            rows.append({"requests": scope, "setting": name, **found, "priced_tokens_per_s": found["tokens"] / seconds})
            print(f"{scope:10s} {name:32s} tok/step {found['tokens_per_step']:.3f}  verified/step "
                  f"{found['verified_per_step']:.2f}  priced {rows[-1]['priced_tokens_per_s']:.2f} tok/s")
    write_report(args.out, {"rows": rows, "step_cost": vars(cost), "requests": len(requests)})


if __name__ == "__main__":
    main()
