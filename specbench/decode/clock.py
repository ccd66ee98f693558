"""Device-correct time: read the clock only after the device has finished the work queued before it.

CUDA (and MPS) kernels run asynchronously: `time.perf_counter()` right after a forward returns
measures its launch, not its run, and the draft/verify split of a step would be wrong. Every time
specbench records around device work goes through `device_time`, on CPU too (where waiting is a
no-op), so the code path the CPU tests exercise is the one a GPU runs.
"""
from __future__ import annotations

import time

import torch


def synchronize(device) -> None:
    """Wait until `device` has finished every queued kernel (nothing to wait for on CPU)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def device_time(device) -> float:
    """`time.perf_counter()` once `device` is idle: the edge of a timed span of device work."""
    synchronize(device)
    return time.perf_counter()
