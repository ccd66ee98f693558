"""Start workers for tests: in a thread (fast) or as a real `specbench worker` process (kill -9 tests)."""
import threading

from specbench.models.spec import ModelSpec
from specbench.worker.launch import free_port, spawn_worker
from specbench.worker.server import Worker, WorkerConfig

TARGET = "tiny-random:seed=0"
DRAFT = "tiny-random:seed=1,noise=0.005,noise_from=0"


class ThreadWorker:
    def __init__(self, **overrides):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        config = dict(bind=self.endpoint, model=ModelSpec(TARGET), draft=ModelSpec(DRAFT), lazy=False)
        config.update(overrides)
        self.lines = []
        self.worker = Worker(WorkerConfig(**config), log=self.lines.append)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.worker.serve, kwargs={"stop": self._stop.is_set}, daemon=True)
        self.thread.start()

    def stop(self):
        self._stop.set()
        self.thread.join(5)


def start_process_worker(endpoint: str, *extra: str):
    return spawn_worker(endpoint, "--model", TARGET, "--draft", DRAFT, *extra, timeout_s=60)
