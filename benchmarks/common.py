"""What every benchmark shares: the project's prompt list, the machine's facts and the JSON report.

Benchmarks run as scripts (`python benchmarks/NAME.py`), so they import this as `common`.
"""
from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch
import transformers

from specbench.datasets import load_prompts
from specbench.hardware import device_name

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def bench_prompts(limit: Optional[int] = None) -> list[str]:
    """The first `limit` prompts of datasets/bench_prompts.jsonl (code and chat, in file order)."""
    rows = load_prompts("bench")
    return [row["prompt"] for row in rows[:limit]]


def machine() -> dict:
    return {"device": device_name("cpu"), "platform": platform.platform(), "processor": platform.processor(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__}


def device_agreement(frame, methods) -> tuple[dict, dict, int]:
    """Rows of `device`, `method`, `prompt`, `text`: per device, how many texts equal the CPU's and how many
    equal target-only's on the same device (lossless there), and how many (method, prompt) texts there are.
    What the GPU smokes report: the same run on the device and on the CPU."""
    texts = frame.pivot_table(index=["method", "prompt"], columns="device", values="text", aggfunc="first")
    same = {device: int((texts[device] == texts["cpu"]).sum()) for device in texts.columns}
    agree = {device: int(sum((texts.loc[method, device] == texts.loc["target-only", device]).sum()
                             for method in methods)) for device in texts.columns}
    return same, agree, len(texts)


def write_report(out: str | Path, report: dict) -> None:
    """Write the benchmark's JSON with the date and machine it was measured on."""
    document = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(), **report}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(document, indent=1, default=str))
    print(f"\nwrote {out}")
