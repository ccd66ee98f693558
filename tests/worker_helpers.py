"""Start workers for tests: in a thread (fast) or as a real worker process (kill -9 tests), forked from a
server that imported the worker once."""
import contextlib
import multiprocessing
import os
import threading

from specbench.models.spec import ModelSpec
from specbench.worker.launch import WorkerLog, free_port
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
    return ForkedWorker(endpoint, "--model", TARGET, "--draft", DRAFT, *extra, timeout_s=60)


# What a client or a worker process needs, imported once by the fork server (`forked`): spawn's fresh interpreter
# costs each client ~6 s of imports and each `specbench worker` ~10 CPU-s on a 2-core CI box (27 workers and
# 15 clients start in `make test`).
PRELOAD = ["worker_helpers", "specbench.api", "specbench.worker.client", "specbench.models.loading", "specbench.cli",
           "specbench.worker.server", "specbench.models.tiny", "transformers.models.llama.modeling_llama"]


def forked():
    """A multiprocessing context whose processes fork from a server that imported `PRELOAD` (forkserver). The
    server is single-threaded when it forks, so each process starts clean: its own pid, memory and sockets."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


class ForkedWorker:
    """`specbench worker ...` run by the CLI's own `main` in a `forked` process, with the face of `spawn_worker`'s
    Popen (pid, poll, wait, kill, send_signal, log_lines) the tests use. Product code and the notebooks start
    workers with `spawn_worker` (a fresh interpreter); tests that stop, kill or restart one use this. Its
    environment is the test process's when the fork server started: a test that sets variables for its worker
    starts it with `spawn_worker`."""

    def __init__(self, endpoint: str, *args: str, timeout_s: float = 60.0):
        context = forked()
        reader, writer = context.Pipe(duplex=False)
        self._process = context.Process(target=_worker_main, args=(["worker", "--bind", endpoint, *args], writer))
        self._process.start()
        writer.close()  # the worker holds the only writing end: its exit ends the log
        # the log reads its own copy of the reading end: the pipe object closing its fd when collected would
        # otherwise pull it from under the reading thread (EBADF, or another file's lines once the number is reused)
        log = WorkerLog(open(os.dup(reader.fileno()), "r"))
        reader.close()
        self.log_lines = log.lines
        log.wait_listening(timeout_s, self.kill, lambda: self.wait(5))

    @property
    def pid(self) -> int:
        return self._process.pid

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        return self._process.exitcode

    def send_signal(self, signum):
        import os

        if self._process.exitcode is None:
            os.kill(self._process.pid, signum)

    def kill(self):
        self._process.kill()


def _worker_main(argv, writer):
    """In the forked process: the worker's log goes up the pipe, line by line."""
    import os
    import sys

    from specbench import cli

    os.dup2(writer.fileno(), 1)
    os.dup2(writer.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(cli.main(argv))


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
