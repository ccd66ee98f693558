"""The remote target worker: a ZeroMQ ROUTER serving many clients, each session with its own KV cache.

Every request gets exactly one reply; a bad request gets an error reply naming the problem and the
worker keeps serving every other session. Verifies waiting from different sessions run in one
batched target forward (`decode/batch.py`); each reply says the batch size and the request's time
in the queue. `--no-batching` handles one request at a time, for comparison. What a client may rely on, and why, is in
`sessions.py` (ownership, exactly-once steps), `model_policy.py` (loads) and `limits.py`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import zmq

from specbench.decode.target import UnknownSessionError as TargetUnknownSessionError
from specbench.types import SpecbenchError
from specbench.worker import protocol
from specbench.worker.inbox import Inbox, Message
from specbench.worker.forward_cost import ForwardCost
from specbench.worker.jobs import CancelledError, Job
from specbench.worker.limits import WorkerLimits
from specbench.worker.model_policy import LoadRefusedError
from specbench.worker.ops import Ops
from specbench.worker.protocol import PROTOCOL_VERSION, LimitError, ProtocolError, field as get
from specbench.worker.sessions import SessionEndedError, StaleStepError, UnknownSessionError
from specbench.models.spec import ModelSpec

ERROR_CODES = (  # most specific first
    (UnknownSessionError, "unknown-session"), (TargetUnknownSessionError, "unknown-session"),
    (StaleStepError, "stale-step"), (SessionEndedError, "model-changed"), (LoadRefusedError, "refused"),
    (LimitError, "limit"), (CancelledError, "cancelled"), (SpecbenchError, "bad-request"))


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
    batching: bool = True  # verifies of different sessions share one forward (`--no-batching`: one at a time)
    batch_window_ms: float = 20.0  # after the first waiting message, how long at least to wait for the others
    # how long at most to wait for a session expected back from drafting (`_drain`); 0: the window only;
    # "auto": a forward's fixed cost, fitted on the worker's own batches (worker/forward_cost.py)
    batch_wait_ms: float | str = "auto"
    max_batch: int = 16  # messages taken in one round
    # new tokens one slice of a long request may compute (a prefill chunk, a profile piece, a generate's
    # prompt chunk): between slices other clients' batches run, so it bounds how long one tenant holds all
    slice_tokens: int = 256
    fast: bool | str | None = None  # the target's fixed-shape steps (`--fast`; None: on CUDA; decode/fast_forward.py)
    # suffix-server's cache of earlier outputs: per tenant (one user's outputs never shape another's drafts),
    # shared by every tenant, or off (each request drafts from itself)
    suffix_cache: str = "tenant"
    router: Optional[str] = None  # a router file (`specbench route`): method auto-server picks per prompt with it
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
    prefill_tokens_batched: int = 0  # prompt tokens fed inside verify batches rather than alone
    batch_wait_s: float = 0.0  # seconds spent gathering batches (waiting for sessions expected back)
    forward: ForwardCost = field(default_factory=ForwardCost)  # seconds = fixed + per token, recent batches
    # a verify round's own work outside the forward (parsing, per-row checks and verdicts, replies):
    # seconds = fixed + per row, recent rounds. On a GPU, where a forward takes a few ms, this is much of a
    # loaded round, and what a prediction from forward profiles alone misses (`plan.predict.HostCost`)
    host: ForwardCost = field(default_factory=lambda: ForwardCost(window=256, spread=0.1))
    # seconds the worker spent computing, per op ("verify": batches and lone verifies, with the prefill
    # chunks riding in them; "prefill", "generate", "profile": job slices): with uptime, how busy it was
    # and what on (a shared target's speedup from batching is capped by the work that does not batch)
    busy_s: dict = field(default_factory=dict)
    # the longest single piece of work per op (a verify batch, a job's slice, a quick request): what one
    # tenant's request can hold every other client for, as measured here
    longest_s: dict = field(default_factory=dict)

    def add_busy(self, op: str, seconds: float) -> None:
        self.busy_s[op] = self.busy_s.get(op, 0.0) + seconds
        self.longest_s[op] = max(self.longest_s.get(op, 0.0), seconds)


class Worker:
    def __init__(self, config: WorkerConfig, log: Callable[[str], None] = print):
        protocol.check_endpoint(config.bind, bind=True)
        if not protocol.is_local_endpoint(config.bind) and not config.curve_keys and not config.insecure:
            raise SpecbenchError(
                f"refusing to bind {config.bind} without CURVE keys: anyone who can reach it could use the "
                f"model. Pass --curve-keys DIR (see `specbench keys`), or --insecure on a trusted network")
        self.config, self.log = config, log
        self.wait_ms = config.batch_wait_ms
        if self.wait_ms != "auto":
            try:
                self.wait_ms = float(self.wait_ms)
            except (TypeError, ValueError):
                raise SpecbenchError(f"--batch-wait-ms takes milliseconds or 'auto', not {self.wait_ms!r}") from None
        self.stats = Stats()
        self._round_s = 0.0  # how long the last round of requests took
        self._batches = 0  # verify batches run: each reply names its batch, so records group rows exactly
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
        jobs = self.ops.jobs
        inbox = Inbox(socket, limits.inbound_queue, curve=authenticator is not None)
        try:
            while not (stop and stop()):
                if inbox.poll(0 if len(jobs) else 200):
                    round_started = time.perf_counter()
                    for message, reply in self.handle_many(self._drain(inbox)):
                        inbox.send([message.identity, *message.envelope, *reply])
                    self._round_s = time.perf_counter() - round_started
                # Long requests: a slice between rounds, and more while no client is waiting; a job
                # cancelled in the round (its session closed) is answered here too.
                while True:
                    for message, reply in self._finished_jobs():
                        inbox.send([message.identity, *message.envelope, *reply])
                    if not len(jobs) or inbox.poll(0):
                        break
                    jobs.advance_one()
                self.ops.expire_idle()
                self.ops.release_idle_memory()
        except KeyboardInterrupt:
            self.log("interrupted: stopping")
        finally:
            inbox.close()  # sends what is queued, closes the socket
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
    def _drain(self, inbox: Inbox) -> list[Message]:
        """Every message waiting now (continuous batching: what arrived while the last batch ran), then
        more until every session expected back soon has one in hand, up to the largest batch. Clients
        answer a batch's replies a few ms apart (target-only, prompt lookup), or after drafting for
        hundreds of ms, each for its own time (a model draft): without waiting, the first one back would
        run alone while the rest queue behind it, and batches, once split, stay split. So a session is
        awaited until its expected return (its last reply + its measured turnaround, plus a margin),
        up to `--batch-wait-ms`; at least `--batch-window-ms`. Waiting pays only while it is shorter
        than a forward's fixed cost (what running the late ones on their own costs extra): a longer
        cap idled a saturated CPU worker (README, concurrency). So by default (`auto`) the cap is that
        fixed cost, fitted on the worker's batches; 0 keeps the window only."""
        config, messages = self.config, []
        limit = config.max_batch if config.batching else 1
        started = time.perf_counter()
        window = config.batch_window_ms / 1000
        wait = max(window, self.wait_cap_s())
        # "recently used": within a few rounds (a round of a 1.5B model on a CPU takes seconds)
        awaited = self.ops.sessions.awaited(within_s=max(2.0, 3 * self._round_s),
                                            horizon=started + wait if wait > window else float("inf"),
                                            excluding=self.ops.jobs.sessions()) if config.batching else []
        deadline = max([started + window] + [min(t + window + 0.25 * max(0.0, t - started), started + wait)
                                             for t in awaited])
        while len(messages) < limit:
            if len(messages) >= max(len(awaited), 1) and not inbox.poll(0):
                break
            wait_ms = max(0, int((deadline - time.perf_counter()) * 1000)) if messages else 0
            if messages and not inbox.poll(wait_ms):
                break
            messages.append(inbox.take())
        self.stats.batch_wait_s += time.perf_counter() - started
        return messages

    def wait_cap_s(self) -> float:
        """The longest a batch waits for a session expected back: `--batch-wait-ms`, or with `auto` the
        fixed cost of a forward fitted on the recent batches (0 until there are enough to fit)."""
        return self.stats.forward.fixed_s() if self.wait_ms == "auto" else self.wait_ms / 1000

    def handle(self, frames: list[bytes], connection: bytes = b"", curve_key: str = "") -> list[bytes]:
        """One request in, one reply out (a long one run to its end); never raises."""
        message = Message(connection, [], frames, curve_key)
        replies = [r for r in self.handle_many([message]) if r[0] is message]
        while not replies:
            self.ops.jobs.advance_one()
            replies = [r for r in self._finished_jobs() if r[0] is message]
        return replies[0][1]

    def handle_many(self, messages: list[Message]) -> list[tuple[Message, list[bytes]]]:
        """A reply for every message, in order of completion; never raises. Verifies of different
        sessions wait in one batch (one target forward); anything else runs alone, after the batch
        gathered so far, so every session still sees its requests in the order they came."""
        out, batch = [], []
        for message in messages:
            self.stats.requests += 1
            message.started = time.perf_counter()  # a reply run now waited this long (batches and jobs: later)
            try:
                header, arrays, op = self._parse(message)
                if op == "verify" and self.config.batching:
                    session = self.ops.verify_session(header, message.curve_key)
                    session.arrived(message.received)
                    if any(prepared.session is session for _, prepared in batch):
                        out += self._run_batch(batch)  # a session's steps run in order
                        batch = []
                    prepared = self.ops.prepare_verify(header, arrays, session)
                    if not isinstance(prepared, tuple):
                        message.host_s = time.perf_counter() - message.started
                        batch.append((message, prepared))
                        continue
                    result = prepared  # a repeated step: its stored reply
                else:
                    if not self._beside(op, header, message, batch):
                        out += self._run_batch(batch)
                        batch = []
                    result = self.ops.handlers[op](header, arrays, connection=message.identity,
                                                   curve_key=message.curve_key)
                    self.stats.add_busy(op, time.perf_counter() - message.started)
                    if isinstance(result, Job):
                        out += self._start(result, message)
                        continue
            except Exception as error:  # every failure becomes an error reply; the worker keeps serving
                result = error
            out.append((message, self._reply(message, result)))
        return out + self._run_batch(batch)

    def _beside(self, op: str, header: dict, message: Message, batch: list) -> bool:
        """Whether a request other than a verify may be handled while the batch gathered so far waits:
        one that reads no session, or closes or opens a session with no step in the batch. Without
        this, a client closing its finished session or opening its next prompt's split every batch it
        arrived in (under steady load, clients do that every few steps)."""
        if not batch or op in ("info", "health", "stats", "tokenizer"):
            return True
        if op not in ("close", "prefill"):
            return False  # loads, generates, profiles: after the batch, as they came
        try:
            named = self.ops.named_session(header, message.curve_key)
        except Exception:
            return False  # the handler names what is wrong, after the batch
        return all(prepared.session is not named for _, prepared in batch)

    def _start(self, job: Job, message: Message) -> list[tuple[Message, list[bytes]]]:
        """Attach `message` to `job`; a short prefill (one slice) runs now, so a verify sent right behind
        it, even in the same round, finds the session live; every other slice runs between rounds, one
        at a time, while no request waits (or a prefill's chunk rides in a verify batch): a long
        request's slices never delay the verifies of the round they came in. With batching off a job runs to its
        end here, as requests did before."""
        job.waiters.append(message)
        if job in self.ops.jobs.jobs:  # a resend joining the job under way
            return []
        self.ops.jobs.add(job)
        if self.config.batching and (job.prefill is None or job.prefill.remaining > self.config.slice_tokens):
            return []  # a long prefill's chunks ride in the next batches or run between rounds
        while not job.advance() and not self.config.batching:
            pass
        return self._finished_jobs() if job.done else []

    def _finished_jobs(self) -> list[tuple[Message, list[bytes]]]:
        out = []
        for job in self.ops.jobs.take_finished():
            for message in job.waiters:
                result = job.result
                if not isinstance(result, Exception):
                    result = (dict(result[0], queue_s=max(0.0, job.started - message.received)), result[1])
                out.append((message, self._reply(message, result)))
        return out

    def _parse(self, message: Message) -> tuple[dict, dict, str]:
        size = sum(len(f) for f in message.frames)
        self.stats.bytes_in += size
        if size > self.config.limits.max_request_bytes:
            raise LimitError(f"message of {size} bytes exceeds the worker's limit of "
                             f"{self.config.limits.max_request_bytes} bytes (--max-request-bytes)")
        header, arrays = protocol.decode(message.frames)
        request_id = header.get("id")
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            message.request_id = request_id
        elif request_id is not None:
            raise ProtocolError("field 'id' must be an int")
        op = get(header, "op", str)
        if op not in self.ops.handlers:
            raise ProtocolError(f"unknown op {op!r}; known ops: {sorted(self.ops.handlers)}")
        return header, arrays, op

    def _run_batch(self, batch: list) -> list[tuple[Message, list[bytes]]]:
        if not batch:
            return []
        started = time.perf_counter()
        prepared = [p for _, p in batch]
        riding = self._riding_prefills()
        fed_before = sum(job.prefill.fed for job, _ in riding)
        try:
            if len(batch) > 1 or riding:
                results = self.ops.verify_many(prepared, [(job.prefill, tokens) for job, tokens in riding])
            else:
                results = [self._alone(prepared[0])]
        except Exception as error:  # the forward itself failed: every row gets the error, no session changed
            results = [error] * len(batch)
        seconds = time.perf_counter() - started
        self.stats.add_busy("verify", seconds)
        succeeded = not any(isinstance(result, Exception) for result in results)
        if succeeded:
            self.stats.forward.add(self._tokens(prepared, riding), seconds)
        self.stats.prefill_tokens_batched += sum(job.prefill.fed for job, _ in riding) - fed_before
        for job, _ in riding:
            if not job.prefill.remaining:
                job.advance()  # its last chunk rode here: the session goes live, the reply goes out this round
        out, replied = [], time.perf_counter()
        self._batches += 1
        for (message, request), result in zip(batch, results):
            if not isinstance(result, Exception):
                result = (dict(result[0], batch_size=len(batch), round=self._batches,
                               queue_s=started - message.received), result[1])
                request.session.replied_at = replied
            out.append((message, self._reply(message, result)))
        if succeeded and not riding:
            forward_s = float(results[0][0]["target_forward_s"])
            self.stats.host.add(len(batch), time.perf_counter() - started - forward_s
                                + sum(message.host_s for message, _ in batch))
        return out

    def _tokens(self, prepared: list, riding: list) -> int:
        """Tokens a batch's forward computed: its rows' (each tree plus the last committed token) and
        the prefill chunks riding in it; a padded target computes every row at the longest one's length."""
        rows = [len(p.request.tree) + 1 for p in prepared]
        packed = self.ops.target is not None and self.ops.target.packed
        return (sum(rows) if packed or len(rows) == 1 else len(rows) * max(rows)) + sum(t for _, t in riding)

    def _riding_prefills(self) -> list:
        """(job, tokens): chunks of waiting prefills to run inside the next verify batch, up to
        `--slice-tokens` tokens in all, oldest prefill first. Only on a packed target (no padding:
        a chunk costs the batch its own tokens, not every row padded to its length)."""
        target = self.ops.target
        if not self.config.batching or target is None or not target.packed:
            return []
        riding, budget = [], self.config.slice_tokens
        for job in self.ops.jobs.prefills():
            tokens = min(budget, job.prefill.remaining)
            if tokens <= 0:
                break
            riding.append((job, tokens))
            budget -= tokens
        return riding

    def _alone(self, prepared):
        request = prepared.request
        try:
            return self.ops.finish_verify(prepared, self.ops.target.verify(request.session, request.tree,
                                                                           request.sampling, request.seed))
        except Exception as error:
            return error

    def _reply(self, message: Message, result) -> list[bytes]:
        if isinstance(result, Exception):
            self.stats.errors += 1
            code = next((code for kind, code in ERROR_CODES if isinstance(result, kind)), "internal")
            text = str(result) if code != "internal" else f"internal error: {type(result).__name__}: {result}"
            if code == "internal":
                self.log(f"error: {text}")
            reply, arrays = {"ok": False, "code": code, "error": text}, None
        else:
            reply, arrays = dict(result[0], ok=True), result[1]
            reply.setdefault("queue_s", max(0.0, (message.started or message.received) - message.received))
        reply["id"] = message.request_id
        reply["worker_s"] = time.perf_counter() - message.received
        out = protocol.encode(reply, arrays)
        self.stats.bytes_out += sum(len(f) for f in out)
        return out

