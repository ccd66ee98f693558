"""The remote target worker: a ZeroMQ ROUTER serving many clients, each session with its own KV cache.

Every request gets exactly one reply; a bad request gets an error reply naming the problem and the
worker keeps serving every other session. Requests are handled one at a time (the model is one
device), so clients interleave step by step.
"""
from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlparse

import numpy as np
import torch
import zmq

from specbench.decode.drafters import ModelDrafter
from specbench.decode.loop import generate
from specbench.decode.target import LocalTarget, UnknownSessionError
from specbench.hardware import device_name
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec
from specbench.types import SpecbenchError
from specbench.worker import protocol
from specbench.worker.protocol import PROTOCOL_VERSION, ProtocolError, encode, field as get

MAX_SESSION_ID = 128


@dataclass
class WorkerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    model: Optional[ModelSpec] = None
    draft: Optional[ModelSpec] = None
    lazy: bool = True
    max_sessions: int = 64
    idle_timeout_s: float = 900.0
    max_request_bytes: int = 1 << 20
    max_kv_bytes: Optional[int] = None
    curve_keys: Optional[str] = None
    insecure: bool = False


@dataclass
class _Stats:
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
        self.target: Optional[LocalTarget] = None
        self.draft = None
        self.sessions: dict[str, float] = {}  # session id -> last use (monotonic seconds)
        self.stats = _Stats()
        self.handlers = {"hello": self._hello, "info": self._info, "health": self._health, "stats": self._stats,
                         "load": self._load, "open": self._open, "close": self._close, "prefill": self._prefill,
                         "verify": self._verify, "profile": self._profile, "generate": self._generate}
        if config.model is not None and not config.lazy:
            self._ensure_loaded(config.model)

    # -- transport -------------------------------------------------------------------------------
    def serve(self, stop: Optional[Callable[[], bool]] = None) -> None:
        context = zmq.Context.instance()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, 16 * self.config.max_request_bytes)  # hard cap; beyond it zmq drops
        authenticator = self._setup_curve(context, socket) if self.config.curve_keys else None
        socket.bind(self.config.bind)
        self.log(f"worker listening on {self.config.bind} (protocol v{PROTOCOL_VERSION}, "
                 f"{'CURVE' if authenticator else 'no auth'}); model: "
                 f"{self.config.model.label if self.config.model else 'none until a client loads one'}")
        try:
            while not (stop and stop()):
                if socket.poll(200):
                    frames = socket.recv_multipart(copy=True)
                    identity, body = frames[0], frames[1:]
                    envelope = [b""] if body and body[0] == b"" else []
                    reply = self.handle(body[len(envelope):])
                    socket.send_multipart([identity, *envelope, *reply])
                self._expire_idle()
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
    def handle(self, frames: list[bytes]) -> list[bytes]:
        """One request in, one reply out; never raises."""
        started = time.perf_counter()
        self.stats.requests += 1
        size = sum(len(f) for f in frames)
        self.stats.bytes_in += size
        request_id = None
        try:
            if size > self.config.max_request_bytes:
                raise ProtocolError(f"message of {size} bytes exceeds the {self.config.max_request_bytes}-byte limit")
            header, arrays = protocol.decode(frames)
            request_id = header.get("id")
            op = get(header, "op", str)
            if op not in self.handlers:
                raise ProtocolError(f"unknown op {op!r}; known ops: {sorted(self.handlers)}")
            reply, out_arrays = self.handlers[op](header, arrays)
            reply = dict(reply, ok=True)
        except Exception as error:  # every failure becomes an error reply; the worker keeps serving
            self.stats.errors += 1
            code = ("unknown-session" if isinstance(error, UnknownSessionError) else
                    "bad-request" if isinstance(error, SpecbenchError) else "internal")
            message = str(error) if code != "internal" else f"internal error: {type(error).__name__}: {error}"
            if code == "internal":
                self.log(f"error: {message}")
            reply, out_arrays = {"ok": False, "code": code, "error": message}, None
        reply["id"] = request_id
        reply["worker_s"] = time.perf_counter() - started
        out = encode(reply, out_arrays)
        self.stats.bytes_out += sum(len(f) for f in out)
        return out

    # -- model and sessions ----------------------------------------------------------------------
    def _ensure_loaded(self, spec: Optional[ModelSpec] = None) -> LocalTarget:
        spec = spec or self.config.model
        if spec is None:
            raise SpecbenchError("no model loaded: start the worker with --model or send a 'load' request")
        if self.target is None or self.target.loaded.spec != spec:
            self.log(f"loading {spec.label} ({spec.dtype}, {spec.device})")
            self.target, self.sessions, self.draft = None, {}, None
            self.target = LocalTarget(load_model(spec))
            self.config.model = spec
            self.log(f"loaded {spec.label}: vocab {self.target.vocab_size}")
        return self.target

    def _session(self, header) -> str:
        session = get(header, "session", str)
        if not 0 < len(session) <= MAX_SESSION_ID:
            raise ProtocolError(f"session id must be 1..{MAX_SESSION_ID} characters")
        return session

    def _touch(self, session: str) -> None:
        if session not in self.sessions:
            raise UnknownSessionError(f"unknown session {session!r}: open it first (it may have expired)")
        self.sessions[session] = time.monotonic()

    def _expire_idle(self) -> None:
        now = time.monotonic()
        for session, last in list(self.sessions.items()):
            if now - last > self.config.idle_timeout_s:
                self._drop(session)
                self.stats.expired += 1
                self.log(f"session {session} expired after {self.config.idle_timeout_s:.0f}s idle")

    def _drop(self, session: str) -> None:
        self.sessions.pop(session, None)
        if self.target is not None:
            self.target.close(session)

    def _kv_bytes(self) -> int:
        if self.target is None:
            return 0
        config = self.target.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * self.target.model.dtype.itemsize
        return per_token * sum(len(s.committed) for s in self.target.sessions.values())

    # -- ops -------------------------------------------------------------------------------------
    def _describe(self) -> dict:
        loaded = self.target.loaded if self.target else None
        return {"protocol": PROTOCOL_VERSION, "model": loaded.spec.label if loaded else None,
                "vocab_size": self.target.vocab_size if self.target else None,
                "eos_token_ids": list(loaded.eos_token_ids) if loaded else [],
                "device": str(self.target.device) if self.target else None,
                "device_name": device_name(str(self.target.device)) if self.target else None,
                "dtype": str(self.target.model.dtype)[6:] if self.target else None,
                "quantization": loaded.spec.quantization if loaded else None,
                "torch": torch.__version__, "sessions": len(self.sessions)}

    def _hello(self, header, arrays):
        version = get(header, "version", int)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"client speaks protocol v{version}, this worker v{PROTOCOL_VERSION}")
        if self.config.model is not None:
            self._ensure_loaded()
        return self._describe(), None

    def _info(self, header, arrays):
        return self._describe(), None

    def _health(self, header, arrays):
        return {"status": "ok"}, None

    def _stats(self, header, arrays):
        s = self.stats
        return {"uptime_s": time.time() - s.started, "requests": s.requests, "errors": s.errors,
                "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "sessions": len(self.sessions),
                "expired": s.expired, "kv_bytes": self._kv_bytes()}, None

    def _load(self, header, arrays):
        spec = _spec_from_wire(get(header, "model", dict))
        self._ensure_loaded(spec)
        return self._describe(), None

    def _open(self, header, arrays):
        session = self._session(header)
        self._ensure_loaded()
        if session not in self.sessions and len(self.sessions) >= self.config.max_sessions:
            raise SpecbenchError(f"session cap reached ({self.config.max_sessions} open); close one or retry later")
        self.sessions[session] = time.monotonic()
        self.log(f"session {session} opened ({len(self.sessions)} open)")
        return {"session": session}, None

    def _close(self, header, arrays):
        session = self._session(header)
        self._drop(session)
        return {"session": session}, None

    def _prefill(self, header, arrays):
        session = self._session(header)
        self._touch(session)
        target = self._ensure_loaded()
        tokens = arrays.get("tokens")
        if tokens is None:
            raise ProtocolError("prefill needs a 'tokens' array")
        if self.config.max_kv_bytes and self._kv_bytes() > self.config.max_kv_bytes:
            raise SpecbenchError(f"KV memory cap of {self.config.max_kv_bytes} bytes reached; close sessions")
        committed = target.prefill(session, tokens.tolist())
        return {"committed": committed}, None

    def _verify(self, header, arrays):
        session = self._session(header)
        self._touch(session)
        target = self._ensure_loaded()
        sampling = protocol.sampling_from_wire(get(header, "sampling", dict))
        seed = get(header, "seed", int)
        tree = protocol.tree_from_arrays(arrays)
        verdict = target.verify(session, tree, sampling, seed)
        return ({"bonus": verdict.bonus_token, "forward_s": verdict.target_forward_s, "verify_s": verdict.verify_s},
                {"path": np.asarray(verdict.accepted_path, dtype=np.int16)})

    def _profile(self, header, arrays):
        from specbench.decode.profile import forward_latency_grid

        target = self._ensure_loaded()
        tokens = [int(x) for x in get(header, "tokens", list, [1, 2, 4, 8, 16])]
        contexts = [int(x) for x in get(header, "contexts", list, [128, 512])]
        repeats = get(header, "repeats", int, 5)
        rows = forward_latency_grid(target.model, tokens, contexts, repeats)
        return {"rows": rows, **self._describe()}, None

    def _generate(self, header, arrays):
        """Server-only baselines: the worker drafts and verifies itself, and returns finished tokens."""
        target = self._ensure_loaded()
        method = get(header, "method", str)
        if method not in ("server-only", "server-only-ar"):
            raise ProtocolError(f"generate supports methods server-only and server-only-ar, not {method!r}")
        drafter = None
        if method == "server-only":
            draft_spec = _spec_from_wire(get(header, "draft", dict)) if "draft" in header else self.config.draft
            if draft_spec is None:
                raise SpecbenchError("server-only needs a draft model: start the worker with --draft or send one")
            if self.draft is None or self.draft.draft.spec != draft_spec:
                self.log(f"loading draft {draft_spec.label}")
                self.draft = ModelDrafter(load_model(draft_spec), target.vocab_size, name="server-draft")
            drafter = self.draft
        prompt = arrays.get("tokens")
        if prompt is None:
            raise ProtocolError("generate needs a 'tokens' array")
        result = generate(target, drafter, prompt.tolist(), k=get(header, "k", int, 4),
                          max_new_tokens=get(header, "max_new_tokens", int),
                          sampling=protocol.sampling_from_wire(get(header, "sampling", dict)),
                          generator=torch.Generator().manual_seed(get(header, "seed", int, 0)),
                          eos_token_ids=target.loaded.eos_token_ids, method=method,
                          session=f"generate-{self.stats.requests}")
        steps = [{"drafted": r.drafted, "accepted": r.accepted, "emitted": r.emitted, "draft_s": r.draft_s,
                  "verify_s": r.verify_s, "forward_s": r.target_forward_s, "step_s": r.step_s}
                 for r in result.records]
        return {"steps": steps, "prefill_s": result.prefill_s}, {"output": np.asarray(result.output_ids, dtype=np.int32)}


def _spec_from_wire(data: dict) -> ModelSpec:
    allowed = {"model", "gguf_file", "dtype", "device", "quantization"}
    unknown = set(data) - allowed
    if unknown:
        raise ProtocolError(f"unknown model spec fields {sorted(unknown)}")
    if not isinstance(data.get("model"), str):
        raise ProtocolError("model spec needs a 'model' string")
    return ModelSpec(**data)


def spec_to_wire(spec: ModelSpec) -> dict:
    return {key: value for key, value in spec.__dict__.items() if value is not None}
