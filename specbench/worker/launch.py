"""Start a `specbench worker` in the background (notebooks, benchmarks, tests) and wait until it listens."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn_worker(endpoint: str, *args: str, timeout_s: float = 300.0) -> subprocess.Popen:
    """`specbench worker --bind endpoint *args` as a child process; returns once it is listening.

    The worker's last log lines are kept on `process.log_lines`. Stop it with `process.terminate()`.
    """
    command = [sys.executable, "-m", "specbench.cli", "worker", "--bind", endpoint, *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + timeout_s
    seen = []
    while time.time() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if "listening on" in line:
            _drain(process, seen)
            return process
        if not line and process.poll() is not None:
            raise RuntimeError(f"worker exited with {process.returncode}: {''.join(seen[-5:])}")
    process.kill()
    raise RuntimeError(f"worker did not start within {timeout_s:.0f}s")


def _drain(process: subprocess.Popen, seen: list[str]) -> None:
    """Keep reading the worker's log so a full pipe never blocks it; the last lines stay on `log_lines`."""
    process.log_lines = deque(seen, maxlen=200)

    def pump():
        for line in process.stdout:
            process.log_lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
