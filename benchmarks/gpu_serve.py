"""`specbench serve` on a device, against the same server on the CPU: one smoke run, fp32 greedy, every offered
method; the texts must be identical (a random tiny Qwen2 pair and a word-level tokenizer made here, so
nothing is downloaded). Prints a table and writes JSON.

    python benchmarks/gpu_serve.py                 # cpu, then cuda where there is one
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from specbench.hardware import device_name
from specbench.serve.background import BackgroundServer
from specbench.serve.settings import ServeSettings
from specbench.worker.launch import free_port

from common import RESULTS, device_agreement, write_report
from gpu_worker import save_model

METHODS = ("target-only", "chain", "prompt-lookup")
PROMPTS = ["w1 w2 w3 w4 w5 w6 w7 w8", "w40 w41 w42 w43 w40 w41 w42", "w9 w80 w3 w17 w23 w9 w80"]


def completions(folder: Path, device: str, args) -> list[dict]:
    import httpx

    settings = ServeSettings(target=str(folder / "target"), draft=str(folder / "draft"), methods=METHODS, k=4,
                             dtype="float32", device=device, port=free_port())
    started = time.perf_counter()
    server = BackgroundServer(settings)
    rows = [{"device": device, "method": "(start)", "seconds": time.perf_counter() - started}]
    try:
        for method in METHODS:
            for index, prompt in enumerate(PROMPTS):
                started = time.perf_counter()
                reply = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
                    "model": settings.target, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "speculative": {"method": method}})
                if reply.status_code != 200:
                    raise RuntimeError(f"{device} {method}: {reply.status_code} {reply.text}")
                body = reply.json()
                rows.append({"device": device, "method": method, "prompt": index, "text": body["choices"][0]["text"],
                             "tokens": body["usage"]["completion_tokens"],
                             "accepted": body["usage"]["speculative"].get("accepted_tokens"),
                             "seconds": time.perf_counter() - started})
    finally:
        server.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", default=str(RESULTS / "gpu-serve.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        save_model("tiny", torch.float32, str(folder / "target"))
        save_model("tiny-draft", torch.float32, str(folder / "draft"))
        rows = [row for device in args.devices for row in completions(folder, device, args)]
    frame = pd.DataFrame(rows)
    print(frame.drop(columns=["text"]).round(3).to_string(index=False))
    # lossless: every method's text is target-only's on the same device
    same, agree, count = device_agreement(frame[frame["method"] != "(start)"], METHODS)
    for device in same:
        print(f"{device}: {same[device]}/{count} completions identical to the CPU's; "
              f"{agree[device]}/{count} identical to target-only's on {device}")
    write_report(args.out, {"devices": {d: device_name(d) for d in args.devices}, "identical": same,
                            "agree_with_target_only": agree,
                            "completions": count, "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
