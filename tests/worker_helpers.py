"""Start workers for tests: in a thread (fast) or as a real `specbench worker` process (kill -9 tests)."""
import contextlib
import multiprocessing
import threading

from specbench.models.spec import ModelSpec
from specbench.worker.launch import free_port, spawn_worker
from specbench.worker.limits import WorkerLimits
from specbench.worker.server import Worker, WorkerConfig

TARGET = "tiny-random:seed=0"
DRAFT = "tiny-random:seed=1,noise=0.005,noise_from=0"


class ThreadWorker:
    def __init__(self, limits=None, **overrides):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        config = dict(bind=self.endpoint, model=ModelSpec(TARGET), draft=ModelSpec(DRAFT), lazy=False)
        config.update(overrides)
        if limits:
            config["limits"] = WorkerLimits(**limits)
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


def client_processes():
    """A multiprocessing context for client processes that imports torch, transformers and the client once (in
    its fork server) instead of once per client: spawn's fresh interpreter costs each client ~6 s of imports
    on a 2-core CI box. The server is single-threaded when it forks, so the clients start clean."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["worker_helpers", "specbench.api", "specbench.worker.client",
                                    "specbench.models.loading"])
    return context


class RawClient:
    """A hand-written pyzmq + msgpack client, not ours: what an outside tester (or attacker) sends."""

    def __init__(self, endpoint: str, token: str | None = None):
        import secrets

        import zmq

        self.endpoint = endpoint
        self.token = token or secrets.token_hex(16)
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def send(self, header: dict, arrays: dict | None = None, *, raw: list | None = None) -> None:
        from specbench.worker import protocol

        frames = raw if raw is not None else protocol.encode(dict({"client": self.token}, **header), arrays)
        self.socket.send_multipart([b"", *frames])

    def receive(self, timeout_s: float = 30.0):
        from specbench.worker import protocol

        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply within {timeout_s}s")
        frames = self.socket.recv_multipart()
        return protocol.decode(frames[1:])

    def request(self, header: dict, arrays: dict | None = None, timeout_s: float = 30.0, *, raw=None):
        self.send(header, arrays, raw=raw)
        return self.receive(timeout_s)

    def close(self):
        self.socket.close(0)


@contextlib.contextmanager
def process_worker(*extra: str):
    """A real `specbench worker` process on a free loopback port, killed on exit; `.endpoint` says where."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = start_process_worker(endpoint, *extra)
    process.endpoint = endpoint
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def decode_in_process(endpoint: str, prompt: list, max_new_tokens: int, method: str, ready, go, results) -> None:
    """A client process (multiprocessing target): greedy-decode `prompt` through the worker once `go`
    is set, stamping the wall time of every verify reply; puts (prompt, output, stamps) on `results`."""
    import time

    from specbench.decode.drafters import ModelDrafter
    from specbench.decode.loop import Decoding, generate
    from specbench.models.loading import load_model
    from specbench.worker.client import RemoteTarget

    remote = RemoteTarget(endpoint, timeout_s=120)
    stamps, verify = [], remote.verify_begin

    def stamped(*args, **kwargs):
        pending = verify(*args, **kwargs)
        result = pending.result

        def result_and_stamp():
            verdict = result()
            stamps.append(time.time())
            return verdict

        pending.result = result_and_stamp
        return pending

    remote.verify_begin = stamped
    drafter = ModelDrafter(load_model(ModelSpec(DRAFT)), remote.vocab_size) if method == "chain" else None
    ready.set()
    go.wait(120)
    decoding = Decoding(3 if drafter else 0, max_new_tokens, method=method, kind="chain" if drafter else "none")
    output = generate(remote, drafter, prompt, decoding, session="s").output_ids
    results.put((prompt, method, output, stamps))
