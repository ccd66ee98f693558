"""Start a `specbench worker` in the background (notebooks, benchmarks, tests) and wait until it listens."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections import deque

from specbench.types import SpecbenchError


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
    log = WorkerLog(process.stdout)
    process.log_lines = log.lines
    log.wait_listening(timeout_s, process.kill, lambda: process.wait(5))
    return process


class WorkerLog:
    """A starting worker's log, read in a thread from its first line: a full pipe never blocks the worker, the
    last 200 lines stay on `lines`, and `wait_listening` holds its deadline even while the worker prints nothing."""

    def __init__(self, stream):
        self.lines: deque[str] = deque(maxlen=200)
        self.listening, self._told = False, threading.Event()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.append(line)
            if not self.listening and "listening on" in line:
                self.listening = True
                self._told.set()
        self._told.set()  # the log ended: the worker exited

    def wait_listening(self, timeout_s: float, kill, exit_code) -> None:
        """Return once the worker listens; else `kill` it (no word within `timeout_s`) or say how it exited
        (`exit_code()`), with its last lines."""
        if not self._told.wait(timeout_s):
            kill()
            raise SpecbenchError(f"worker did not start within {timeout_s:.0f}s")
        if not self.listening:
            raise SpecbenchError(f"worker exited with {exit_code()}: {''.join(list(self.lines)[-5:])}")
