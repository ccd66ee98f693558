"""RemoteTarget: the worker as a drop-in Target, with timeouts, reconnects and session recovery.

The client holds every session's committed tokens, so when the worker dies or forgets a session,
the client reconnects, re-prefills from those tokens and resends the step: no token is lost or
duplicated, and with the same step seed the verdict is the same one an uninterrupted run gets.
Every step names the state it expects, so a resend is never applied twice (worker/sessions.py).
"""
from __future__ import annotations

import itertools
import random
import re
import secrets
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import zmq

from specbench.decode.loop import Generation
from specbench.decode.target import check_token_ids
from specbench.models.spec import ModelSpec
from specbench.types import DraftTree, SamplingParams, SpecbenchError, StepRecord, Timing, Verdict
from specbench.worker import protocol
from specbench.worker.protocol import PROTOCOL_VERSION


_UNFETCHED = object()  # a RemoteTarget's tokenizer not asked of its worker yet


class WorkerError(SpecbenchError):
    """The worker answered with an error reply; `code` says which kind (see the README's table)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class ModelChangedError(WorkerError):
    """The worker's model is not the one this client's sessions were decoding with: stopping is the
    only way to keep the output exactly what that model would produce."""


class SessionStateError(WorkerError):
    """The worker confirmed a session state (committed length) other than the one this client holds."""


class WorkerUnavailableError(SpecbenchError):
    """The worker did not answer within the timeout, after every retry."""


@dataclass(frozen=True)
class NetworkEmulation:
    """Added delay on the client, reported as emulated: half the RTT each way, plus jitter and
    serialization time at `bandwidth_mbps` (0 = unlimited)."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 0.0
    seed: int = 0

    def one_way_s(self, num_bytes: int, rng: random.Random) -> float:
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) / 2 if self.jitter_ms else 0.0
        transfer = num_bytes * 8 / (self.bandwidth_mbps * 1e6) if self.bandwidth_mbps else 0.0
        return max(0.0, (self.rtt_ms / 2 + jitter) / 1000 + transfer)


@dataclass
class _Session:
    wire: str  # the session's name on the worker: unique per prefill, so a late close never hits a new one
    tokens: list[int]  # every committed token, so the session can be rebuilt anywhere
    epoch: int = 0  # prefills sent; the worker refuses requests of an older epoch
    features: Optional[list] = None  # per cached position, for a client-side draft head (`keep_features`)
    wish: Optional[tuple] = None  # (layer ids, wire dtype) of those features


class RemoteTarget:
    """A Target whose model lives in a `specbench worker` process.

    Every request that changes a session names the state it expects (epoch, committed length), so a
    request resent after a timeout is answered from the worker's record instead of applied twice,
    and every reply is checked against the state and the model identity this client holds: a
    mismatch raises, it is never decoded on.
    """

    def __init__(self, endpoint: str, model: Optional[ModelSpec | str] = None, timeout_s: float = 60.0,
                 retries: int = 3, network: Optional[NetworkEmulation] = None,
                 curve_keys: Optional[str] = None, tokenizer=None):
        if retries < 0 or timeout_s <= 0:
            raise SpecbenchError(f"need timeout_s > 0 and retries >= 0, got {timeout_s} and {retries}")
        self.endpoint, self.timeout_s, self.retries = endpoint, timeout_s, retries
        self.network = network or NetworkEmulation()
        self._rng = random.Random(self.network.seed)
        self.curve_keys = curve_keys
        self.token = secrets.token_hex(16)  # owns this client's sessions; sent with every request, never logged
        self.context = zmq.Context.instance()
        self.socket = None
        self._ids = itertools.count()
        self._sessions: dict[str, _Session] = {}
        self._featured: dict[str, tuple[list[int], str]] = {}  # session -> (layer ids, wire dtype) a head reads
        self.reconnects = 0
        protocol.check_endpoint(endpoint)
        self._connect()
        self.info = self._request({"op": "hello", "version": PROTOCOL_VERSION})[0]
        if model is not None:
            spec = model if isinstance(model, ModelSpec) else ModelSpec(model)
            self.info = self._request({"op": "load", "model": protocol.spec_to_wire(spec)})[0]
        if self.info.get("vocab_size") is None:
            raise SpecbenchError(f"worker at {endpoint} has no model loaded: pass model=... or start it with --model")
        self.vocab_size = int(self.info["vocab_size"])
        self.eos_token_ids = tuple(self.info.get("eos_token_ids", ()))
        self.model_identity = self.info["identity"]
        self._tokenizer = tokenizer if tokenizer is not None else _UNFETCHED

    @property
    def tokenizer(self):
        """The target's tokenizer: the one given, else the worker's own, fetched once when first read (tokens
        travel per step, text does not: text prompts and a draft of another tokenizer need it here). None
        when the worker's model has none, or the worker predates the op."""
        if self._tokenizer is _UNFETCHED:
            from specbench.worker.tokenizer_files import known_tokenizer, tokenizer_from_files

            known, self._tokenizer = known_tokenizer(self.model_identity)
            if known:
                return self._tokenizer
            try:
                reply = self._request({"op": "tokenizer"})[0]
            except WorkerError as error:
                if "unknown op" not in str(error):  # else an older worker: no such op
                    raise
                self._tokenizer = None
                return None
            if reply.get("identity") != self.model_identity:
                raise ModelChangedError(f"the worker now serves {reply.get('identity')}, not {self.model_identity}: "
                                        f"its tokenizer may not be this client's", "model-changed")
            self._tokenizer = tokenizer_from_files(reply.get("files"), self.model_identity)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    # -- Target interface ------------------------------------------------------------------------
    def prefill(self, session: str, token_ids: Sequence[int]) -> int:
        ids = check_token_ids(token_ids, self.vocab_size, "prompt")
        if not ids:
            raise SpecbenchError("empty prompt: at least one token is needed to condition on")
        wire = f"{uuid.uuid4().hex[:12]}-{re.sub(r'[^A-Za-z0-9_.:@+-]', '_', session)}"[:128]
        wish = self._featured.get(session)
        self._sessions[session] = _Session(wire, list(ids), features=[] if wish else None, wish=wish)
        self._prefill_wire(self._sessions[session])
        return len(ids)

    def keep_features(self, session: str, layer_ids: Sequence[int], dtype: str = "float16") -> None:
        """From `session`'s next prefill on, the worker sends the inputs of `layer_ids` for every position
        it commits (a draft head on this side reads them, `features`): [positions, layers x hidden] in
        `dtype` per reply, so the bytes per step grow with the accepted tokens and the hidden size."""
        self._featured[session] = (list(layer_ids), dtype)

    def features(self, session: str) -> list:
        rows = self._state(session).features
        if rows is None:
            raise SpecbenchError(f"session {session!r} keeps no features: it was prefilled before a draft head "
                                 f"asked for them (keep_features)")
        return rows

    def verify(self, session: str, tree: DraftTree, sampling: SamplingParams, seed: int) -> Verdict:
        return self.verify_begin(session, tree, sampling, seed).result()

    def verify_begin(self, session: str, tree: DraftTree, sampling: SamplingParams, seed: int) -> "PendingVerify":
        """Send a verify and return at once; `ready()` polls, `result()` waits (and recovers if needed)."""
        state = self._state(session)
        header = {"op": "verify", "session": state.wire, "epoch": state.epoch, "committed": len(state.tokens),
                  "sampling": protocol.sampling_to_wire(sampling), "seed": seed, "model": self.model_identity}
        arrays = protocol.tree_to_arrays(tree)
        return PendingVerify(self, session, tree, header, arrays, self._launch(header, arrays))

    def close(self, session: str) -> None:
        """Sent without waiting: closing is idempotent and the worker expires idle sessions anyway."""
        state = self._sessions.pop(session, None)
        self._featured.pop(session, None)
        if state is not None and self.socket is not None:
            self._launch({"op": "close", "session": state.wire}, None)

    # -- worker-side operations ------------------------------------------------------------------
    def generate_on_worker(self, method: str, prompt_ids: Sequence[int], *, k: int, max_new_tokens: int,
                           sampling: SamplingParams, seed: int, prompt_index: int = 0,
                           draft: Optional[ModelSpec] = None, suffix=None, family: Optional[str] = None) -> Generation:
        """Server-only baselines (AutoDraft's Server-Only and Server-Only-AR): only finished tokens travel.
        `suffix` (SuffixSettings): its step knobs (floor, factor, ...) shape the worker's suffix drafting, and
        its cache scope picks the worker's cache (`protocol.suffix_to_wire`). `family`: the prompt's, which
        auto-server's router may start from."""
        # `model`: run only on the model this client decodes with; `request`: a resend after a timeout
        # joins (or replays) the run under way instead of starting a second one
        header = {"op": "generate", "method": method, "k": k, "max_new_tokens": max_new_tokens,
                  "sampling": protocol.sampling_to_wire(sampling), "seed": seed, "model": self.model_identity,
                  "request": uuid.uuid4().hex}
        if draft is not None:
            header["draft"] = protocol.spec_to_wire(draft)
        knobs = protocol.suffix_to_wire(suffix, method) if suffix is not None else {}
        if knobs:
            header["suffix"] = knobs
        if family is not None:
            header["family"] = str(family)
        reply, arrays, timing = self._request(header, {"tokens": np.asarray(list(prompt_ids), dtype=np.int32)},
                                              with_timing=True)
        self._confirm_model(reply)
        steps = max(len(reply["records"]), 1)
        # The one round trip is shared out over the steps, so per-step records still add up.
        share, emulated = timing["network_s"] / steps, timing["emulated_network_s"] / steps
        records = [replace(StepRecord(**fields), prompt_index=prompt_index, network_s=share,
                           emulated_network_s=emulated, step_s=fields["step_s"] + share,
                           bytes_up=timing["bytes_up"] if i == 0 else 0, bytes_down=timing["bytes_down"] if i == 0 else 0)
                   for i, fields in enumerate(reply["records"])]
        if "chosen" in reply:  # the worker routed it: rows keep the method asked for, and say what ran
            records = [replace(record, method=method) for record in records]
        generation = Generation(prompt_index, list(prompt_ids), arrays["output"].tolist(), float(reply["prefill_s"]),
                                records)
        generation.route = {key: reply[key] for key in ("chosen", "route_predicted", "route_default", "route_note",
                                                        "cache_held_prompt") if key in reply}
        return generation

    def profile(self, tokens=(1, 2, 4, 8, 16), contexts=(128, 512), repeats: int = 5, batches=(1,)) -> dict:
        return self._request({"op": "profile", "tokens": list(tokens), "contexts": list(contexts),
                              "repeats": repeats, "batches": list(batches)})[0]

    def stats(self) -> dict:
        return self._request({"op": "stats"})[0]

    def health(self) -> bool:
        return self._request({"op": "health"})[0].get("status") == "ok"

    def committed(self, session: str) -> list[int]:
        return list(self._state(session).tokens)

    # -- sessions --------------------------------------------------------------------------------
    def _state(self, session: str) -> _Session:
        if session not in self._sessions:
            raise SpecbenchError(f"unknown session {session!r}; call prefill first")
        return self._sessions[session]

    def _prefill_wire(self, state: _Session) -> None:
        """(Re)build the session on the worker from the tokens held here, in a new epoch."""
        state.epoch += 1
        header = {"op": "prefill", "session": state.wire, "epoch": state.epoch, "model": self.model_identity}
        if state.wish is not None:
            header.update(features=state.wish[0], feature_dtype=state.wish[1])
        reply, arrays = self._request(header, {"tokens": np.asarray(state.tokens, dtype=np.int32)})
        self._confirm(reply, len(state.tokens))
        if state.wish is not None:  # a rebuilt session's rows replace what was held
            state.features = _feature_rows(arrays, len(state.tokens) - 1)

    def _confirm(self, reply: dict, committed: int) -> None:
        """The worker's view of the session must be this client's; otherwise stop, loudly."""
        self._confirm_model(reply)
        if reply.get("committed") != committed:
            raise SessionStateError(f"the worker holds {reply.get('committed')} committed tokens for this session "
                                    f"but this client holds {committed}", "state-mismatch")

    def _confirm_model(self, reply: dict) -> None:
        if reply.get("model") != self.model_identity:
            raise ModelChangedError(f"the worker now serves {reply.get('model')} but this client's sessions "
                                    f"decode with {self.model_identity}: stopping rather than mixing models",
                                    "model-changed")

    # -- transport -------------------------------------------------------------------------------
    def _connect(self) -> None:
        if self.socket is not None:
            self.socket.close(0)
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if self.curve_keys:
            from zmq.auth import load_certificate

            keys = Path(self.curve_keys)
            public, secret = load_certificate(keys / "client.key_secret")
            server_public, _ = load_certificate(keys / "server.key")
            self.socket.curve_publickey, self.socket.curve_secretkey = public, secret
            self.socket.curve_serverkey = server_public
        self.socket.connect(self.endpoint)

    def _launch(self, header: dict, arrays: Optional[dict]) -> "_Flight":
        """Send a request now; emulated delay is applied to when its reply may be *seen*, so the
        client is free to work (proactive drafting) while the request is in flight."""
        request_id = next(self._ids)
        frames = protocol.encode(dict(header, id=request_id, client=self.token), arrays)
        started = time.perf_counter()  # before sending: the worker may start (and time) its work at once
        self.socket.send_multipart([b"", *frames])
        bytes_up = sum(len(f) for f in frames)
        return _Flight(request_id, header["op"], started, bytes_up, self.network.one_way_s(bytes_up, self._rng))

    def _poll(self, flight: "_Flight", wait_s: float) -> bool:
        """Wait up to `wait_s` for the flight's reply; True once it arrived and its emulated delay passed."""
        deadline = time.perf_counter() + wait_s
        while flight.frames is None:
            remaining = deadline - time.perf_counter()
            if not self.socket.poll(max(0, int(remaining * 1000))):
                if time.perf_counter() >= deadline:
                    return False
                continue
            frames = self.socket.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames
            try:
                header, _ = protocol.decode(body)
            except SpecbenchError:
                continue
            if header.get("id") == flight.request_id:  # late replies to abandoned requests are dropped
                flight.frames, flight.arrived = body, time.perf_counter()
                flight.down_delay = self.network.one_way_s(sum(len(f) for f in body), self._rng)
        pause = flight.arrived + flight.up_delay + flight.down_delay - time.perf_counter()
        if pause > 0:
            if pause > deadline - time.perf_counter():
                return False
            time.sleep(pause)
        return True

    def _request(self, header: dict, arrays: Optional[dict] = None, session: Optional[str] = None,
                 with_timing: bool = False, flight: Optional["_Flight"] = None):
        """Send (or finish an in-flight request) and wait up to `timeout_s` per try. On silence,
        reconnect and resend the same request: the worker applies a step once and answers a repeat
        from its record. On a forgotten session (worker restarted, session expired), rebuild it
        from the tokens held here and resend in the new epoch."""
        tries = self.retries + 1
        last_error: Optional[SpecbenchError] = None
        for _ in range(tries):
            flight = flight or self._launch(header, arrays)
            if not self._poll(flight, self.timeout_s):
                flight = None
                self.reconnects += 1
                self._connect()  # a fresh socket: a dead peer can leave a DEALER wedged
                last_error = WorkerUnavailableError(
                    f"worker at {self.endpoint} did not answer {header['op']} within {self.timeout_s:g}s on any of "
                    f"{tries} tries ({self.timeout_s * tries:g}s in all)")
                continue
            reply, reply_arrays = protocol.decode(flight.frames)
            if not reply.get("ok"):
                error = _worker_error(header["op"], reply)
                if error.code != "unknown-session" or session is None:
                    raise error
                flight, last_error = None, error
                self._prefill_wire(self._sessions[session])  # raises if the worker's model or state differs
                header = dict(header, epoch=self._sessions[session].epoch)
                continue
            round_trip = time.perf_counter() - flight.started
            timing = {"network_s": max(0.0, round_trip - float(reply.get("worker_s", 0.0))),
                      "bytes_up": flight.bytes_up, "bytes_down": sum(len(f) for f in flight.frames),
                      "emulated_network_s": flight.up_delay + flight.down_delay}
            return (reply, reply_arrays, timing) if with_timing else (reply, reply_arrays)
        raise last_error

    def disconnect(self) -> None:
        for session in list(self._sessions):
            self.close(session)
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None


def _worker_error(op: str, reply: dict) -> WorkerError:
    code = str(reply.get("code", "?"))
    kind = ModelChangedError if code == "model-changed" else WorkerError
    return kind(f"worker refused {op} ({code}): {reply.get('error')}", code)


def _feature_rows(arrays: dict, count: int) -> list:
    """The reply's feature rows (float32 tensors), checked to be the `count` positions it committed."""
    import torch

    rows = arrays.get("features")
    if rows is None or rows.ndim != 2 or rows.shape[0] != count:
        raise SessionStateError(f"the worker sent {None if rows is None else rows.shape} feature rows for a step "
                                f"that committed {count} positions", "state-mismatch")
    return list(torch.from_numpy(rows.astype(np.float32)).unbind(0))


@dataclass
class _Flight:
    request_id: int
    op: str
    started: float
    bytes_up: int
    up_delay: float
    frames: Optional[list] = None
    arrived: float = 0.0
    down_delay: float = 0.0


class PendingVerify:
    """A verify in flight: lets the caller draft ahead until the (possibly emulated) reply lands."""

    def __init__(self, client: RemoteTarget, session: str, tree: DraftTree, header: dict, arrays: dict,
                 flight: _Flight):
        self.client, self.session, self.tree = client, session, tree
        self.header, self.arrays, self.flight = header, arrays, flight

    def ready(self) -> bool:
        return self.client._poll(self.flight, 0.0)

    def result(self) -> Verdict:
        reply, arrays, timing = self.client._request(self.header, self.arrays, session=self.session,
                                                     with_timing=True, flight=self.flight)
        path = tuple(int(i) for i in arrays["path"].tolist())
        bonus = int(reply["bonus"])
        state = self.client._state(self.session)
        self.client._confirm(reply, len(state.tokens) + len(path) + 1)
        if state.features is not None:
            state.features += _feature_rows(arrays, len(path) + 1)
        state.tokens += [self.tree.tokens[i] for i in path] + [bonus]
        return Verdict(path, bonus, Timing(
            target_forward_s=float(reply["target_forward_s"]), verify_s=float(reply["verify_s"]),
            queue_s=float(reply.get("queue_s", 0.0)), batch_size=int(reply.get("batch_size", 1)),
            batch_round=int(reply.get("round", -1)),
            network_s=timing["network_s"], emulated_network_s=timing["emulated_network_s"], bytes_up=timing["bytes_up"],
            bytes_down=timing["bytes_down"]))
