"""Draft heads and suffix decoding on a device, against the same runs on the CPU: one smoke run, fp32 greedy.

A head is trained here for a few seconds on a tiny random target (`specbench.heads.train`, on the CPU:
nothing is downloaded), then the target decodes the same prompts with target-only, eagle, eagle-tree,
suffix and the two hybrids (suffix-eagle, suffix-eagle-tree) on each device, with `run`'s defaults (on CUDA
the fast path, which yields to the head methods), and two methods with a draft model of their own (`@draft`, a
noisy copy of the target): its chain and the confident hybrid (`suffix-tree-chain-confident`).
Every method's tokens must equal target-only's on that device, and each device's must equal the CPU's.
Prints a table and writes JSON.

    python benchmarks/gpu_heads.py                 # cpu, then cuda where there is one
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from specbench.hardware import device_name

from common import RESULTS, device_agreement, write_report

METHODS = ("target-only", "eagle", "eagle-tree", "suffix", "suffix-eagle", "suffix-eagle-tree", "chain@draft",
           "suffix-tree-chain-confident@draft")
TARGET = "tiny-random:seed=0,layers=4"


def train(folder: Path) -> tuple[Path, list]:
    """A head trained on the target's own responses to a few prompts (enough that it is accepted)."""
    from specbench.heads.train import TrainSpec, train_head

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(14))
    spec = TrainSpec(target=TARGET, prompts=prompts, prompt_count=14, held_out=2, max_new_tokens=16, draft_vocab=96,
                     labels="greedy", ttt_steps=3, epochs=30, learning_rate=3e-3, batch=4, checkpoint_every=1000,
                     eval_every=10_000)
    train_head(spec, folder, progress=False)
    return folder / "head", [list(p) for p in prompts[2:8]]


def decode(head: Path, prompts: list, device: str, max_new_tokens: int) -> list[dict]:
    from specbench.api import outputs, run
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.models.tiny import tiny_model

    target = tiny_model(seed=0, num_layers=4)
    draft = tiny_model(seed=1, num_layers=4, noise_from=target, noise_scale=0.005)  # accepted about half the time
    target.model.to(device)
    draft.model.to(device)
    started = time.perf_counter()
    records = run(target, prompts, method=list(METHODS), draft=str(head), drafts={"draft": draft}, k=4,
                  max_new_tokens=max_new_tokens, progress=False, warmup=False,
                  suffix=SuffixSettings(cache="drafter"))  # not the CPU run's outputs
    seconds = time.perf_counter() - started
    got = outputs(records)
    rows = []
    for method in METHODS:
        steps = records[records["method"] == method]
        for index in range(len(prompts)):
            rows.append({"device": device, "method": method, "prompt": index, "tokens": got[(method, index)],
                         "accepted_per_step": float(steps.loc[steps["prompt_index"] == index, "accepted"].mean())
                         if "accepted" in steps else None})
    print(f"{device}: {len(METHODS)} methods x {len(prompts)} prompts in {seconds:.1f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", default=str(RESULTS / "gpu-heads.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        head, prompts = train(Path(folder))
        print(f"head trained in {time.perf_counter() - started:.1f} s", flush=True)
        rows = [row for device in args.devices for row in decode(head, prompts, device, args.max_new_tokens)]
    frame = pd.DataFrame(rows)
    frame["text"] = frame["tokens"].map(lambda ids: " ".join(map(str, ids)))
    same, agree, outputs = device_agreement(frame, METHODS)
    accepted = frame.groupby(["device", "method"])["accepted_per_step"].mean().unstack("device")
    print(accepted.round(3).to_string())
    for device in same:
        print(f"{device}: {same[device]}/{outputs} outputs identical to the CPU's; "
              f"{agree[device]}/{outputs} identical to target-only's on {device}")
    write_report(args.out, {"devices": {d: device_name(d) for d in args.devices}, "identical": same,
                            "agree_with_target_only": agree, "outputs": outputs,
                            "accepted_per_step": accepted.round(4).to_dict()})


if __name__ == "__main__":
    main()
