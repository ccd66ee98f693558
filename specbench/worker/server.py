"""The remote target worker: a ZeroMQ ROUTER serving many clients, each session with its own KV cache.

Every request gets exactly one reply; a bad request gets an error reply naming the problem and the
worker keeps serving every other session. Requests are handled one at a time (the model is one
device), so clients interleave step by step. What a client may rely on, and why, is in
`sessions.py` (ownership, exactly-once steps), `model_policy.py` (loads) and `limits.py`.
"""
from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlparse

import numpy as np
import zmq

from specbench.decode.target import UnknownSessionError as TargetUnknownSessionError
from specbench.types import SpecbenchError
from specbench.worker import protocol
from specbench.worker.limits import WorkerLimits
from specbench.worker.model_policy import LoadRefusedError
from specbench.worker.ops import Ops
from specbench.worker.protocol import PROTOCOL_VERSION, LimitError, ProtocolError, field as get
from specbench.worker.sessions import SessionEndedError, StaleStepError, UnknownSessionError
from specbench.models.spec import ModelSpec

ERROR_CODES = (  # most specific first
    (UnknownSessionError, "unknown-session"), (TargetUnknownSessionError, "unknown-session"),
    (StaleStepError, "stale-step"), (SessionEndedError, "model-changed"), (LoadRefusedError, "refused"),
    (LimitError, "limit"), (SpecbenchError, "bad-request"))


@dataclass
class WorkerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    model: Optional[ModelSpec] = None
    draft: Optional[ModelSpec] = None
    device: str = "cpu"
    lazy: bool = False  # load the model on first use rather than at start (`--lazy`)
    allow_load: tuple[str, ...] = ()  # models clients may load besides --model / --draft
    idle_timeout_s: float = 900.0
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    curve_keys: Optional[str] = None
    insecure: bool = False


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    requests: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    expired: int = 0


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address."""
    parsed = urlparse(endpoint)
    if parsed.scheme in ("ipc", "inproc"):
        return True
    host = (parsed.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Worker:
    def __init__(self, config: WorkerConfig, log: Callable[[str], None] = print):
        if not is_local_endpoint(config.bind) and not config.curve_keys and not config.insecure:
            raise SpecbenchError(
                f"refusing to bind {config.bind} without CURVE keys: anyone who can reach it could use the "
                f"model. Pass --curve-keys DIR (see `specbench keys`), or --insecure on a trusted network")
        self.config, self.log = config, log
        self.stats = Stats()
        self.ops = Ops(config, self.stats, log)
        if config.model is not None and not config.lazy:
            self.ops.ensure_loaded()

    # -- transport -------------------------------------------------------------------------------
    def serve(self, stop: Optional[Callable[[], bool]] = None) -> None:
        limits = self.config.limits
        context = zmq.Context.instance()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        # Messages a little over the limit get a reply naming it; far over, zmq drops the peer unread.
        socket.setsockopt(zmq.MAXMSGSIZE, 4 * limits.max_request_bytes)
        socket.setsockopt(zmq.RCVHWM, limits.inbound_queue)
        authenticator = self._setup_curve(context, socket) if self.config.curve_keys else None
        socket.bind(self.config.bind)
        self.log(f"worker listening on {self.config.bind} (protocol v{PROTOCOL_VERSION}, "
                 f"{'CURVE' if authenticator else 'no auth'}); model: "
                 f"{self.config.model.label if self.config.model else 'none until a client loads one'}")
        allowed = ", ".join(self.config.allow_load) or ("embedded catalog models" if self.config.model is None else
                                                       "nothing else")
        self.log(f"limits: {self.ops.describe()['limits']}; clients may also load: {allowed}")
        try:
            while not (stop and stop()):
                if socket.poll(200):
                    frames = socket.recv_multipart(copy=False)
                    identity, body = frames[0].bytes, frames[1:]
                    key = (body[-1].get("User-Id") or "") if authenticator and body else ""
                    envelope = [b""] if body and body[0].bytes == b"" else []
                    reply = self.handle([f.bytes for f in body[len(envelope):]], identity, key)
                    socket.send_multipart([identity, *envelope, *reply])
                self.ops.expire_idle()
        except KeyboardInterrupt:
            self.log("interrupted: stopping")
        finally:
            socket.close(0)
            if authenticator:
                authenticator.stop()
            self.log(f"worker stopped after {self.stats.requests} requests")

    def _setup_curve(self, context, socket):
        from zmq.auth import load_certificate
        from zmq.auth.thread import ThreadAuthenticator

        keys = Path(self.config.curve_keys)
        public, secret = load_certificate(keys / "server.key_secret")
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(keys / "clients"))
        socket.curve_publickey, socket.curve_secretkey, socket.curve_server = public, secret, True
        return authenticator

    # -- dispatch --------------------------------------------------------------------------------
    def handle(self, frames: list[bytes], connection: bytes = b"", curve_key: str = "") -> list[bytes]:
        """One request in, one reply out; never raises."""
        started = time.perf_counter()
        self.stats.requests += 1
        size = sum(len(f) for f in frames)
        self.stats.bytes_in += size
        request_id = None
        try:
            if size > self.config.limits.max_request_bytes:
                raise LimitError(f"message of {size} bytes exceeds the worker's limit of "
                                 f"{self.config.limits.max_request_bytes} bytes (--max-request-bytes)")
            header, arrays = protocol.decode(frames)
            request_id = header.get("id")
            if not isinstance(request_id, (int, type(None))) or isinstance(request_id, bool):
                request_id = None
                raise ProtocolError("field 'id' must be an int")
            op = get(header, "op", str)
            handler = self.ops.handlers.get(op)
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}; known ops: {sorted(self.ops.handlers)}")
            reply, out_arrays = handler(header, arrays, connection=connection, curve_key=curve_key)
            reply = dict(reply, ok=True)
        except Exception as error:  # every failure becomes an error reply; the worker keeps serving
            self.stats.errors += 1
            code = next((code for kind, code in ERROR_CODES if isinstance(error, kind)), "internal")
            message = str(error) if code != "internal" else f"internal error: {type(error).__name__}: {error}"
            if code == "internal":
                self.log(f"error: {message}")
            reply, out_arrays = {"ok": False, "code": code, "error": message}, None
        reply["id"] = request_id
        reply["worker_s"] = time.perf_counter() - started
        out = protocol.encode(reply, out_arrays)
        self.stats.bytes_out += sum(len(f) for f in out)
        return out
