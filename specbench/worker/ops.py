"""What the worker does for each op: validate against the limits first, then touch the model.

Every handler takes `(header, arrays, *, connection, curve_key)` and returns `(reply, arrays)`;
errors are raised as SpecbenchError subclasses that `server.py` turns into coded replies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from specbench.decode.batch import VerifyRequest
from specbench.decode.suffix_drafter import process_cache_totals
from specbench.decode.target import LocalTarget
from specbench.hardware import device_name
from specbench.models.spec import ModelSpec
from specbench.types import SpecbenchError
from specbench.worker import long_requests, protocol
from specbench.worker.jobs import CancelledError, Job, JobQueue, ReplyStore
from specbench.worker.limits import check
from specbench.worker.model_policy import LoadPolicy, LoadRefusedError, model_identity
from specbench.worker.protocol import MAX_SEED, PROTOCOL_VERSION, LimitError, ProtocolError, field as get
from specbench.worker.sessions import (Session, SessionEndedError, SessionTable, StaleStepError, check_step,
                                       request_key)
from specbench.worker.tokenizer_files import tokenizer_files


@dataclass
class PreparedVerify:
    session: Session
    key: tuple
    epoch: int
    request: VerifyRequest


class Ops:
    def __init__(self, config, stats, log: Callable[[str], None]):
        self.config, self.stats, self.log, self.limits = config, stats, log, config.limits
        self.policy = LoadPolicy(config.device, config.model, config.draft, config.allow_load)
        self.sessions = SessionTable(self.limits)
        self.jobs = JobQueue()  # prefills, generates and profiles under way, a slice per round
        self.generated = ReplyStore()  # finished generates' replies, for a resend after a timeout
        self.target: Optional[LocalTarget] = None
        self.identity: Optional[str] = None
        self.draft = None
        self.heads: dict = {}  # the draft head server-side head methods draft with, by its spec
        self.router = None  # auto-server's router, loaded on first use from --router
        self.suffix_names: dict = {}  # per tenant, the suffix caches it named, least recently used first
        self.kv_budget = self.limits.max_kv_bytes or _half_free_memory(config.device)
        self.handlers = {"hello": self.hello, "info": self.info, "health": self.health, "stats": self.stats_op,
                         "load": self.load, "prefill": self.prefill, "verify": self.verify, "close": self.close,
                         "profile": self.profile, "generate": self.generate, "tokenizer": self.tokenizer}
        self._tokenizer_files: tuple = (None, {})  # (identity, files): written once per model

    # -- model -----------------------------------------------------------------------------------
    def ensure_loaded(self) -> LocalTarget:
        if self.target is None:
            if self.config.model is None:
                raise SpecbenchError("no model loaded: start the worker with --model or send a 'load' request")
            self._install(self.config.model, reason="")
        return self.target

    def _install(self, spec: ModelSpec, reason: str) -> None:
        """Load `spec` while the old model keeps serving; only a successful load replaces it."""
        from specbench.models.loading import load_model

        self.log(f"loading {spec.label} ({spec.dtype}, {spec.device})")
        loaded = load_model(spec)
        identity = model_identity(loaded)
        old, live = self.identity, self.sessions.live()
        self.target, self.identity = LocalTarget(loaded, fast=self.config.fast), identity
        self.kv_per_token = loaded.kv_bytes_per_token  # read once: the model's dtype walks every parameter
        if self.target.pool is not None:  # the pool's rows are as long as its longest session: bound it too
            self.target.pool.max_bytes = self.kv_budget
        if self.target.fast is not None:  # a fast target's static caches hold their full capacity each
            self.target.fast.max_bytes = self.kv_budget
            pool = self.target.fast.pool  # rows for a few clients now: a growing pool moves (shapes recompile)
            rows = FAST_ROWS + (self.target.fast.backend != "compile")  # captured batches pad into a scratch row
            pool.reserve_slots(min(rows, self.kv_budget // pool.slot_bytes if self.kv_budget else rows))
        self.draft, self.heads = None, {}  # a server-side drafter is bound to the target it was built for
        self.jobs.cancel_all(SessionEndedError(f"the worker's model changed from {old} to {identity} ({reason}) "
                                               f"while this request ran"))
        if live:
            self.sessions.end(live, f"the worker's model changed from {old} to {identity} ({reason})")
            self.log(f"{len(live)} sessions of {old} ended: {reason}")
        self.log(f"loaded {identity}: vocab {self.target.vocab_size}")

    def check_model(self, header: dict) -> None:
        """A request that names the model identity its client decodes with (`model`) runs only on that
        model: after another client's allowed load, a server-only generate returned another model's
        tokens with no error, and a prefill's out-of-vocabulary ids were answered as a bad request."""
        expected = get(header, "model", str, None)
        if expected is not None and expected != self.identity:
            raise SessionEndedError(f"the worker now serves {self.identity}, not the {expected} this request was "
                                    f"made for (another client loaded it): stopping rather than mixing models")

    def owner(self, header: dict, curve_key: str) -> tuple[str, str]:
        """(namespace, quota principal): the CURVE key where there is one, else the client's token."""
        token = protocol.client_token(header)
        return f"{curve_key}:{token}", curve_key or token

    def check_kv(self, incoming: int, replacing: int = 0, what: str = "this request") -> None:
        per_token = self.kv_per_token
        needed = self.kv_bytes() + per_token * (incoming - replacing)
        if self.kv_budget and needed > self.kv_budget:
            raise LimitError(f"KV cache: {what} needs {needed} bytes in all ({incoming} new tokens x "
                             f"{per_token} bytes, with what the worker holds) and exceeds the worker's limit of "
                             f"{self.kv_budget} bytes (--max-kv-gib)")

    def kv_bytes(self) -> int:
        """What the sessions hold: their KV, and the feature rows kept for client-side heads."""
        if self.target is None:
            return 0
        return self.kv_per_token * sum(len(s.committed) for s in self.target.sessions.values()) + _feature_bytes(
            self.target)

    def release_idle_memory(self) -> None:
        """Once no session is open and no request under way, give the KV pool's memory back (and the
        allocator's free pages to the system). A fast target keeps its static pool: its captured graphs
        read those tensors, and a smaller pool would mean capturing them again."""
        target = self.target
        if target is None or target.pool is None or len(self.sessions) or len(self.jobs) or target.sessions:
            return
        dropped = target.pool.release_memory()
        if dropped:
            _trim_allocator()
            self.log(f"no session open: released {dropped / 2**20:.0f} MiB of KV pool")

    def expire_idle(self) -> None:
        for session in self.sessions.idle(self.config.idle_timeout_s):
            self.sessions.remove(session.owner, session.name)
            self.jobs.cancel(session.key, CancelledError(f"session {session.name} expired"))
            if self.target is not None:
                self.target.close(session.key)
            if session.ended is None:
                self.stats.expired += 1
                self.log(f"session {session.name} expired after {self.config.idle_timeout_s:.0f}s idle")

    # -- ops without sessions --------------------------------------------------------------------
    def describe(self) -> dict:
        loaded = self.target.loaded if self.target else None
        return {"protocol": PROTOCOL_VERSION, "model": loaded.spec.label if loaded else None,
                "identity": self.identity, "vocab_size": self.target.vocab_size if self.target else None,
                "eos_token_ids": list(loaded.eos_token_ids) if loaded else [],
                "device": str(self.target.device) if self.target else None,
                "device_name": device_name(str(self.target.device)) if self.target else None,
                "dtype": loaded.spec.dtype if loaded else None,
                "quantization": loaded.spec.quantization if loaded else None,
                "weight_bytes": loaded.weight_bytes if loaded else None,
                "kv_bytes_per_token": loaded.kv_bytes_per_token if loaded else None,
                # what a client-side draft head checks itself against
                "hidden_size": getattr(loaded.model.config, "hidden_size", None) if loaded else None,
                "num_hidden_layers": getattr(loaded.model.config, "num_hidden_layers", None) if loaded else None,
                "torch": torch.__version__, "sessions": len(self.sessions),
                "kv_pool": _pool_description(self.target),
                # batches run packed (no padding) or padded: what `replay_speed` needs to price them
                "packed_batches": bool(self.target and self.target.packed),
                # the fast path's backend and forwards so far (batched: several sessions' verifies in one)
                "fast": dict(self.target.fast.stats, backend=self.target.fast.backend,
                             shapes=len(self.target.fast.shapes) + len(self.target.fast.batch_shapes))
                if self.target and self.target.fast else None,
                "limits": {**self.limits.__dict__, "max_kv_bytes": self.kv_budget}}

    def hello(self, header, arrays, **_):
        version = get(header, "version", int)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"client speaks protocol v{version}, this worker v{PROTOCOL_VERSION}")
        if self.config.model is not None:
            self.ensure_loaded()
        return self.describe(), None

    def info(self, header, arrays, **_):
        return self.describe(), None

    def tokenizer(self, header, arrays, **_):
        """The loaded model's tokenizer as files (none for a model without one): for clients given text."""
        target = self.ensure_loaded()
        if self._tokenizer_files[0] != self.identity:
            self._tokenizer_files = (self.identity, tokenizer_files(target.loaded.tokenizer))
        return {"identity": self.identity, "files": self._tokenizer_files[1]}, None

    def health(self, header, arrays, **_):
        return {"status": "ok"}, None

    def stats_op(self, header, arrays, **_):
        s = self.stats
        fixed, per_token = s.forward.fit() or (None, None)  # a forward's cost, fitted on recent batches
        host_fixed, host_row = s.host.fit() or (None, None)  # a round's own work outside it, per row
        return {"uptime_s": time.time() - s.started, "requests": s.requests, "errors": s.errors,
                "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "sessions": len(self.sessions),
                "expired": s.expired, "kv_bytes": self.kv_bytes(),
                "prefill_tokens_batched": s.prefill_tokens_batched, "busy_s": dict(s.busy_s),
                "longest_s": dict(s.longest_s),
                "batch_wait_s": s.batch_wait_s, "forward_fixed_s": fixed, "forward_token_s": per_token,
                "host_fixed_s": host_fixed, "host_row_s": host_row, "host_rounds": len(s.host.samples),
                "host_mean_s": sum(y for _, y in s.host.samples) / len(s.host.samples) if s.host.samples else None,
                **process_cache_totals()}, None

    def load(self, header, arrays, *, connection, curve_key):
        spec = protocol.spec_from_wire(get(header, "model", dict))
        _, principal = self.owner(header, curve_key)
        self.policy.check(spec)
        if self.target is not None and self.target.loaded.spec == spec:
            return self.describe(), None
        others = [s for s in self.sessions.live() if s.principal != principal]
        if others:
            raise LoadRefusedError(f"the worker's model {self.identity} is in use by {len(others)} sessions of "
                                   f"other clients; loading {spec.label} would end them")
        self._install(spec, reason=f"a load of {spec.label} by the sessions' own client")
        return self.describe(), None

    def check_jobs(self, header, curve_key) -> str:
        """A client's long requests under way (generates, profiles) count against its session quota:
        one client's many jobs would otherwise take every slice between rounds."""
        _, principal = self.owner(header, curve_key)
        running = sum(job.principal == principal for job in self.jobs.jobs if not job.done)
        check(running + 1, self.limits.max_sessions_per_client, "long requests under way of this client",
              "--max-sessions-per-client")
        return principal

    def profile(self, header, arrays, *, connection, curve_key):
        return long_requests.profile(self, header, curve_key)

    def generate(self, header, arrays, *, connection, curve_key):
        return long_requests.generate(self, header, arrays, curve_key)

    # -- session ops -----------------------------------------------------------------------------
    def prefill(self, header, arrays, *, connection, curve_key):
        """A job feeding the prompt `--slice-tokens` tokens per slice (a short one finishes in its first
        slice); the session keeps its old state until the last chunk is in. A resend of the same prefill
        joins the job under way; a newer prefill of the session supersedes it."""
        owner, principal = self.owner(header, curve_key)
        name = protocol.name_field(header, "session")
        epoch = protocol.integer(header, "epoch", 1, MAX_SEED)
        tokens = protocol.array(arrays, "tokens")
        check(len(tokens), self.limits.max_prompt_tokens, "prompt tokens", "--max-prompt-tokens")
        target = self.ensure_loaded()
        self.check_model(header)
        ids = target.check_prompt(tokens.tolist())  # refused before a session exists, so none is left behind
        key = request_key("prefill", epoch, len(tokens), header, arrays)
        existing = self.sessions.sessions.get((owner, name))
        if existing is not None:
            if existing.ended is not None:
                raise SessionEndedError(f"session {name!r} ended: {existing.ended}")
            running = self.jobs.for_session(existing.key)
            if running is not None and running.key == key:
                return running
            stored = check_step(existing, key)
            if stored is not None:
                return dict(stored[0], replayed=True), stored[1]
            if running is not None:
                running.cancel(StaleStepError(f"prefill of session {name!r} superseded by a newer one "
                                              f"(epoch {epoch})"))
                existing = self.sessions.sessions.get((owner, name))
        self.check_kv(incoming=len(tokens), replacing=existing.committed if existing else 0)
        features = self._feature_request(header, target)
        session = self.sessions.admit(owner, name, principal, connection, self.identity)
        session.feature_dtype = features and features[1]
        if features:
            target.keep_features(session.key, features[0])
        job = target.prefill_job(session.key, ids)
        chunk = self.config.slice_tokens if self.config.batching else len(tokens)
        if existing is None:
            self.log(f"session {name} opened ({len(self.sessions)} open)")

        def run():
            try:
                while not job.advance(chunk):
                    yield
            except BaseException:  # failed or cancelled: a session this prefill opened goes again
                if existing is None and self.sessions.sessions.get((owner, name)) is session:
                    self.sessions.remove(owner, name)
                raise
            session.epoch, session.committed = epoch, len(job.ids)
            reply = {"session": name, "epoch": epoch, "committed": session.committed, "model": session.model}
            out = _features_out(session, job.state.features)
            session.replay = (key, reply, out)
            return reply, out

        return Job(run(), session_key=session.key, key=key, principal=principal, prefill=job, op="prefill",
                   busy=self.stats.add_busy)

    def _feature_request(self, header, target) -> Optional[tuple[list[int], str]]:
        """(layer ids, wire dtype) of a prefill whose client drafts with a head (`features`), checked
        against the model before any session exists; None when it asks for none."""
        if "features" not in header:
            return None
        layers = protocol.int_list(header, "features", 0)
        count = target.model.config.num_hidden_layers
        if not 1 <= len(layers) <= 8 or max(layers) >= count:
            raise ProtocolError(f"field 'features' names the decoder layers a head reads: 1..8 ids below {count}, "
                                f"got {layers}")
        dtype = get(header, "feature_dtype", str, "float16")
        if dtype not in ("float16", "float32"):
            raise ProtocolError(f"field 'feature_dtype' is float16 or float32, got {dtype!r}")
        from specbench.heads.features import attach

        attach(target, layers)  # refused (another head's layers, a fast target) before a session exists
        return layers, dtype

    def verify(self, header, arrays, *, connection, curve_key):
        """One verify alone (batching off, or a batch of one)."""
        prepared = self.prepare_verify(header, arrays, self.verify_session(header, curve_key))
        if isinstance(prepared, tuple):
            return prepared
        request = prepared.request
        return self.finish_verify(prepared, self.target.verify(request.session, request.tree, request.sampling,
                                                                request.seed))

    def verify_session(self, header, curve_key) -> Session:
        """The caller's session a verify names; the scheduler needs it before deciding to batch."""
        owner, _ = self.owner(header, curve_key)
        return self.sessions.find(owner, protocol.name_field(header, "session"))

    def named_session(self, header, curve_key) -> Optional[Session]:
        """The caller's session a request names, if it is open (the scheduler's ordering check)."""
        owner, _ = self.owner(header, curve_key)
        return self.sessions.sessions.get((owner, protocol.name_field(header, "session")))

    def prepare_verify(self, header, arrays, session: Session):
        """A stored reply (a repeated step) as (reply, arrays), or the validated request to run."""
        epoch = protocol.integer(header, "epoch", 1, MAX_SEED)
        committed = protocol.integer(header, "committed", 1, MAX_SEED)
        sampling = protocol.sampling_from_wire(get(header, "sampling", dict))
        seed = protocol.integer(header, "seed", 0, MAX_SEED)
        tree = protocol.tree_from_arrays(arrays, max_nodes=self.limits.max_tree_nodes)
        key = request_key("verify", epoch, committed, header, arrays)
        stored = check_step(session, key)
        if stored is not None:
            return dict(stored[0], replayed=True), stored[1]
        target = self.ensure_loaded()
        self.check_model(header)
        if target.max_context and session.committed + len(tree) + 1 > target.max_context:
            raise LimitError(f"a verify of {len(tree)} draft nodes on {session.committed} committed tokens needs "
                             f"{session.committed + len(tree) + 1} positions; the model's context is "
                             f"{target.max_context} ({target.max_context - session.committed - 1} nodes left)")
        self.check_kv(incoming=len(tree) + 1)
        return PreparedVerify(session, key, epoch, VerifyRequest(session.key, tree, sampling, seed))

    def finish_verify(self, prepared: "PreparedVerify", verdict) -> tuple[dict, dict]:
        session = prepared.session
        session.committed += len(verdict.accepted_path) + 1
        reply = {"bonus": verdict.bonus_token, "target_forward_s": verdict.timing.target_forward_s,
                 "verify_s": verdict.timing.verify_s, "epoch": prepared.epoch, "committed": session.committed,
                 "model": session.model}
        path = {"path": np.asarray(verdict.accepted_path, dtype=np.int32)}
        if session.feature_dtype:  # this step's new rows: the old tail's position and the accepted path's
            rows = self.target.state(session.key).features[-(len(verdict.accepted_path) + 1):]
            path.update(_features_out(session, rows))
        session.replay = (prepared.key, reply, path)
        return reply, path

    def verify_many(self, prepared: list["PreparedVerify"], prefills=()) -> list:
        """Each prepared verify's (reply, arrays), or the error its own row raised: one forward for all,
        with `prefills`' (job, tokens) chunks riding along."""
        from specbench.decode.batch import verify_batch

        verdicts = verify_batch(self.target, [p.request for p in prepared], prefills)
        return [v if isinstance(v, Exception) else self.finish_verify(p, v) for p, v in zip(prepared, verdicts)]

    def close(self, header, arrays, *, connection, curve_key):
        owner, _ = self.owner(header, curve_key)
        name = protocol.name_field(header, "session")
        session = self.sessions.remove(owner, name)
        if session is not None:
            self.jobs.cancel(session.key, CancelledError(f"session {name!r} was closed while its prefill ran"))
        if session is not None and self.target is not None:
            self.target.close(session.key)
        # idempotent (a resent close is fine), but says whether it closed anything: a name that is not the
        # caller's session (never opened, expired, or another client's) closes nothing
        return {"session": name, "closed": session is not None}, None


def _feature_bytes(target: LocalTarget) -> int:
    """Bytes of the feature rows the worker keeps for sessions whose head drafts on the client."""
    return sum(len(state.features) * state.features[0].numel() * state.features[0].element_size()
               for state in target.sessions.values() if state.features)


def _features_out(session: Session, rows) -> Optional[dict]:
    """A client-side head's feature rows as a reply array, in the dtype its client asked for."""
    if not session.feature_dtype:
        return None
    width = rows[0].shape[-1] if rows else 0
    stacked = torch.stack(rows).float() if rows else torch.zeros(0, width)
    return {"features": stacked.numpy().astype(session.feature_dtype)}


FAST_ROWS = 8  # static pool rows (+ 1 where batches pad) a fast worker holds from the start: graphs are per pool size


def _pool_description(target: Optional[LocalTarget]) -> Optional[dict]:
    pool = None if target is None else target.fast.pool if target.fast is not None else target.pool
    if pool is None:
        return None
    return {"slots": pool.slots, "in_use": pool.in_use, "capacity": pool.capacity, "bytes": pool.nbytes()}


def _trim_allocator() -> None:
    """glibc keeps freed pages for reuse; hand them back so the worker's RSS falls with its load."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): the pages stay mapped until reused
        pass


def _half_free_memory(device: str) -> Optional[int]:
    from specbench.models.loading import available_bytes

    free = available_bytes(device)
    return free // 2 if free else None
