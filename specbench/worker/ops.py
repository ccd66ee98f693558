"""What the worker does for each op: validate against the limits first, then touch the model.

Every handler takes `(header, arrays, *, connection, curve_key)` and returns `(reply, arrays)`;
errors are raised as SpecbenchError subclasses that `server.py` turns into coded replies.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch

from specbench.decode.batch import VerifyRequest
from specbench.decode.target import LocalTarget
from specbench.hardware import device_name
from specbench.methods import METHODS
from specbench.models.spec import ModelSpec
from specbench.types import SpecbenchError
from specbench.worker import protocol
from specbench.worker.jobs import CancelledError, Job, JobQueue
from specbench.worker.limits import check
from specbench.worker.model_policy import LoadPolicy, LoadRefusedError, model_identity
from specbench.worker.protocol import PROTOCOL_VERSION, LimitError, ProtocolError, field as get
from specbench.worker.sessions import (Session, SessionEndedError, SessionTable, StaleStepError, check_step,
                                       request_key)

MAX_SEED = 2**63 - 1


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
        self.target: Optional[LocalTarget] = None
        self.identity: Optional[str] = None
        self.draft = None
        self.kv_budget = self.limits.max_kv_bytes or _half_free_memory(config.device)
        self.handlers = {"hello": self.hello, "info": self.info, "health": self.health, "stats": self.stats_op,
                         "load": self.load, "prefill": self.prefill, "verify": self.verify, "close": self.close,
                         "profile": self.profile, "generate": self.generate}

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
            pool.reserve(min(rows, self.kv_budget // pool.slot_bytes if self.kv_budget else rows))
        self.jobs.cancel_all(SessionEndedError(f"the worker's model changed from {old} to {identity} ({reason}) "
                                               f"while this request ran"))
        if live:
            self.sessions.end(live, f"the worker's model changed from {old} to {identity} ({reason})")
            self.log(f"{len(live)} sessions of {old} ended: {reason}")
        self.log(f"loaded {identity}: vocab {self.target.vocab_size}")

    def _owner(self, header: dict, curve_key: str) -> tuple[str, str]:
        """(namespace, quota principal): the CURVE key where there is one, else the client's token."""
        token = protocol.client_token(header)
        return f"{curve_key}:{token}", curve_key or token

    def _check_kv(self, incoming: int, replacing: int = 0) -> None:
        target = self.target
        per_token = self.kv_per_token
        held = sum(len(s.committed) for s in target.sessions.values()) - replacing
        needed = per_token * (held + incoming)
        if self.kv_budget and needed > self.kv_budget:
            raise LimitError(f"KV cache: this request needs {needed} bytes in all ({incoming} new tokens x "
                             f"{per_token} bytes) and exceeds the worker's limit of {self.kv_budget} bytes "
                             f"(--max-kv-gib)")

    def kv_bytes(self) -> int:
        if self.target is None:
            return 0
        return self.kv_per_token * sum(len(s.committed) for s in self.target.sessions.values())

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

    def health(self, header, arrays, **_):
        return {"status": "ok"}, None

    def stats_op(self, header, arrays, **_):
        s = self.stats
        fixed, per_token = s.forward.fit() or (None, None)  # a forward's cost, fitted on recent batches
        return {"uptime_s": time.time() - s.started, "requests": s.requests, "errors": s.errors,
                "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "sessions": len(self.sessions),
                "expired": s.expired, "kv_bytes": self.kv_bytes(),
                "prefill_tokens_batched": s.prefill_tokens_batched, "busy_s": dict(s.busy_s),
                "batch_wait_s": s.batch_wait_s, "forward_fixed_s": fixed, "forward_token_s": per_token}, None

    def load(self, header, arrays, *, connection, curve_key):
        spec = protocol.spec_from_wire(get(header, "model", dict))
        _, principal = self._owner(header, curve_key)
        self.policy.check(spec)
        if self.target is not None and self.target.loaded.spec == spec:
            return self.describe(), None
        others = [s for s in self.sessions.live() if s.principal != principal]
        if others:
            raise LoadRefusedError(f"the worker's model {self.identity} is in use by {len(others)} sessions of "
                                   f"other clients; loading {spec.label} would end them")
        self._install(spec, reason=f"a load of {spec.label} by the sessions' own client")
        return self.describe(), None

    def _check_jobs(self, header, curve_key) -> str:
        """A client's long requests under way (generates, profiles) count against its session quota:
        one client's many jobs would otherwise take every slice between rounds."""
        _, principal = self._owner(header, curve_key)
        running = sum(job.principal == principal for job in self.jobs.jobs if not job.done)
        check(running + 1, self.limits.max_sessions_per_client, "long requests under way of this client",
              "--max-sessions-per-client")
        return principal

    def profile(self, header, arrays, *, connection, curve_key):
        from specbench.decode.profile import forward_latency_points

        tokens = protocol.int_list(header, "tokens", 1, [1, 2, 4, 8, 16])
        contexts = protocol.int_list(header, "contexts", 1, [128, 512])
        repeats = protocol.integer(header, "repeats", 1, None, 5)
        batches = protocol.int_list(header, "batches", 1, [1])
        limits = self.limits
        check(len(tokens) * len(contexts) * len(batches), limits.max_profile_points, "profile grid points",
              "--max-profile-points")
        check(max(batches, default=1), limits.max_sessions, "profile batch size", "--max-sessions")
        check(repeats, limits.max_profile_repeats, "profile repeats", "--max-profile-repeats")
        check(max(tokens, default=0), limits.max_tree_nodes, "profile tokens per forward", "--max-tree-nodes")
        check(max(contexts, default=0), limits.max_prompt_tokens, "profile context", "--max-prompt-tokens")
        target = self.ensure_loaded()
        if target.max_context:
            check(max(tokens, default=0) + max(contexts, default=0), target.max_context,
                  "profile context + tokens", "the model's context length")
        points = forward_latency_points(target.model, tokens, contexts, repeats, batches=batches,
                                        fast=target.fast.backend if target.fast else None)

        def run():
            rows = []
            for row in points:  # one grid point per slice
                rows.append(row)
                yield
            return {"rows": rows, **self.describe()}, None

        return Job(run(), principal=self._check_jobs(header, curve_key), op="profile", busy=self.stats.add_busy)

    def generate(self, header, arrays, *, connection, curve_key):
        """Server-only baselines: the worker drafts and verifies itself, and returns finished tokens."""
        from specbench.decode.loop import Decoding, generate_steps
        from specbench.methods import DraftSource
        from specbench.models.loading import load_model

        method = get(header, "method", str)
        if method not in METHODS or not METHODS[method].on_worker:
            on_worker = [name for name, m in METHODS.items() if m.on_worker]
            raise ProtocolError(f"generate runs the worker methods {on_worker}, not {method!r}")
        limits = self.limits
        max_new_tokens = protocol.integer(header, "max_new_tokens", 1)
        check(max_new_tokens, limits.max_new_tokens, "max_new_tokens of a generate", "--max-new-tokens")
        principal = self._check_jobs(header, curve_key)
        k = protocol.integer(header, "k", 1, None, 4)
        check(k, limits.max_tree_nodes, "k of a generate", "--max-tree-nodes")
        prompt = protocol.array(arrays, "tokens")
        check(len(prompt), limits.max_prompt_tokens, "prompt tokens", "--max-prompt-tokens")
        sampling = protocol.sampling_from_wire(get(header, "sampling", dict))
        seed = protocol.integer(header, "seed", 0, MAX_SEED, 0)
        draft_spec = protocol.spec_from_wire(header["draft"]) if "draft" in header else self.config.draft
        target = self.ensure_loaded()
        self._check_kv(incoming=len(prompt) + max_new_tokens + k)
        drafter = None
        if METHODS[method].kind != "none":  # the worker drafts too
            if draft_spec is None:
                raise SpecbenchError("server-only needs a draft model: start the worker with --draft or send one")
            self.policy.check(draft_spec)
            if self.draft is None or self.draft.draft.spec != draft_spec:
                self.log(f"loading draft {draft_spec.label}")
                # through the method table, so a draft with another tokenizer is translated, not misread
                self.draft = DraftSource(target, target.loaded, load_model(draft_spec)).model_drafter("server-draft")
            drafter = self.draft
        decoding = Decoding(k, max_new_tokens, sampling, method=method, kind=METHODS[method].kind)
        steps = generate_steps(target, drafter, prompt.tolist(), decoding, seed=seed,
                               session=f"generate/{self.stats.requests}")

        def run():  # one speculative step per slice; closing it closes the target session
            result = yield from steps
            return ({"records": [asdict(record) for record in result.records], "prefill_s": result.prefill_s},
                    {"output": np.asarray(result.output_ids, dtype=np.int32)})

        return Job(run(), principal=principal, op="generate", busy=self.stats.add_busy)

    # -- session ops -----------------------------------------------------------------------------
    def prefill(self, header, arrays, *, connection, curve_key):
        """A job feeding the prompt `--prefill-chunk` tokens per slice (a short one finishes in its first
        slice); the session keeps its old state until the last chunk is in. A resend of the same prefill
        joins the job under way; a newer prefill of the session supersedes it."""
        owner, principal = self._owner(header, curve_key)
        name = protocol.name_field(header, "session")
        epoch = protocol.integer(header, "epoch", 1, MAX_SEED)
        tokens = protocol.array(arrays, "tokens")
        check(len(tokens), self.limits.max_prompt_tokens, "prompt tokens", "--max-prompt-tokens")
        target = self.ensure_loaded()
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
        self._check_kv(incoming=len(tokens), replacing=existing.committed if existing else 0)
        session = self.sessions.admit(owner, name, principal, connection, self.identity)
        job = target.prefill_job(session.key, tokens.tolist())
        chunk = self.config.prefill_chunk if self.config.batching else len(tokens)
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
            session.replay = (key, reply, None)
            return reply, None

        return Job(run(), session_key=session.key, key=key, prefill=job, op="prefill", busy=self.stats.add_busy)

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
        owner, _ = self._owner(header, curve_key)
        return self.sessions.find(owner, protocol.name_field(header, "session"))

    def named_session(self, header, curve_key) -> Optional[Session]:
        """The caller's session a request names, if it is open (the scheduler's ordering check)."""
        owner, _ = self._owner(header, curve_key)
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
        self.ensure_loaded()
        self._check_kv(incoming=len(tree) + 1)
        return PreparedVerify(session, key, epoch, VerifyRequest(session.key, tree, sampling, seed))

    def finish_verify(self, prepared: "PreparedVerify", verdict) -> tuple[dict, dict]:
        session = prepared.session
        session.committed += len(verdict.accepted_path) + 1
        reply = {"bonus": verdict.bonus_token, "target_forward_s": verdict.timing.target_forward_s,
                 "verify_s": verdict.timing.verify_s, "epoch": prepared.epoch, "committed": session.committed,
                 "model": session.model}
        path = {"path": np.asarray(verdict.accepted_path, dtype=np.int32)}
        session.replay = (prepared.key, reply, path)
        return reply, path

    def verify_many(self, prepared: list["PreparedVerify"], prefills=()) -> list:
        """Each prepared verify's (reply, arrays), or the error its own row raised: one forward for all,
        with `prefills`' (job, tokens) chunks riding along."""
        from specbench.decode.batch import verify_batch

        verdicts = verify_batch(self.target, [p.request for p in prepared], prefills)
        return [v if isinstance(v, Exception) else self.finish_verify(p, v) for p, v in zip(prepared, verdicts)]

    def close(self, header, arrays, *, connection, curve_key):
        owner, _ = self._owner(header, curve_key)
        name = protocol.name_field(header, "session")
        session = self.sessions.remove(owner, name)
        if session is not None:
            self.jobs.cancel(session.key, CancelledError(f"session {name!r} was closed while its prefill ran"))
        if session is not None and self.target is not None:
            self.target.close(session.key)
        # idempotent (a resent close is fine), but says whether it closed anything: a name that is not the
        # caller's session (never opened, expired, or another client's) closes nothing
        return {"session": name, "closed": session is not None}, None


FAST_ROWS = 8  # static pool rows (+ 1 where batches pad) a fast worker holds from the start: graphs are per pool size


def _pool_description(target: Optional[LocalTarget]) -> Optional[dict]:
    pool = None if target is None else target.fast.pool if target.fast is not None else target.pool
    if pool is None:
        return None
    return {"slots": pool.slots, "in_use": pool.in_use, "capacity": pool.capacity, "bytes": pool.nbytes()}


def _half_free_memory(device: str) -> Optional[int]:
    from specbench.models.loading import available_bytes

    free = available_bytes(device)
    return free // 2 if free else None
