"""A server in a thread of this process (notebooks, benchmarks, tests): `specbench serve` without a terminal."""
from __future__ import annotations

import threading
import time

from specbench.serve.settings import ServeSettings
from specbench.types import SpecbenchError


class BackgroundServer:
    """Starts `specbench serve` with `settings` on its host and port and returns once it answers.

    `url` is its address, `app.state.engine` its engine; `close()` stops the server, then its engine
    (and the worker started in this process, if any)."""

    def __init__(self, settings: ServeSettings, log=lambda line: None, timeout_s: float = 300.0):
        import uvicorn

        from specbench.serve import build_app

        self.app = build_app(settings, log=log)
        self.engine = self.app.state.engine
        self.url = f"http://{settings.host}:{settings.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=settings.host, port=settings.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="specbench-serve")
        self.thread.start()
        deadline = time.time() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                self.engine.close()
                raise SpecbenchError(f"the server did not start on {self.url}")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.close()
