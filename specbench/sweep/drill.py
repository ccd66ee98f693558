"""A fault drill: kill -9 a Ray worker while it runs a sweep cell, to check that nothing is lost.

Used by the tests and `benchmarks/sweep.py`, and by users checking a cluster's recovery before a
long sweep. Ray titles a worker process "ray::<function>" while it runs a task, which is how the
running cell's process is found (this machine's processes only).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Union

TASK_TITLE = "ray::run_cell"


def kill_running_cell_later(folder: Union[str, Path], after_landed: int = 1, timeout_s: float = 300.0) -> dict:
    """Start a thread that, once `after_landed` cells have results under `folder`, kills one process
    running a cell. Returns a dict that gets "pid" (and "at", a time.time()) when the kill happened."""
    import psutil

    killed: dict = {}
    cells = Path(folder) / "cells"

    def watch():
        deadline = time.time() + timeout_s
        while time.time() < deadline and not killed:
            if len(list(cells.glob("*.parquet"))) >= after_landed:
                for process in psutil.process_iter(["pid", "cmdline"]):
                    if TASK_TITLE in " ".join(process.info["cmdline"] or []):
                        os.kill(process.info["pid"], signal.SIGKILL)
                        killed.update(pid=process.info["pid"], at=time.time())
                        return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True, name="sweep-kill-drill").start()
    return killed
