"""The serving engine: one request's speculative generation, step by step, over a shared worker.

Why a worker even for one machine: concurrent requests must share one target, and the batching
worker already does that (each request a session of its own, verifies batched, tenants taking
turns). With no `--worker`, one is started in this process on a loopback port. Each running
request holds one RemoteTarget connection and one drafter from small pools, so at most
`max_concurrent` generations run; the draft's weights are loaded once and shared.
"""
from __future__ import annotations

import copy
import queue
import random
import threading
import uuid
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from specbench.decode.loop import Decoding, generate_steps
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.hardware import target_device
from specbench.methods import DraftSource, get_method
from specbench.models.loading import load_tokenizer
from specbench.models.spec import label_model
from specbench.serve.settings import AUTO, RequestError, ServeSettings, Speculation
from specbench.serve.text import Piece, TextStream
from specbench.types import SamplingParams, SpecbenchError, StepRecord


@dataclass(frozen=True)
class Job:
    """One request, as the engine runs it."""

    prompt_ids: list[int]
    max_tokens: int
    speculation: Speculation
    sampling: SamplingParams = SamplingParams()
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()


@dataclass
class Event:
    """What one step added (`pieces`), or the end (`finish_reason` set, `records` complete)."""

    pieces: list[Piece] = field(default_factory=list)
    finish_reason: Optional[str] = None
    records: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    route: Optional[dict] = None  # method auto: what the router chose, and every candidate's predicted tokens/s

    @property
    def completion_tokens(self) -> int:
        """Tokens generated: every emitted token of the recorded steps (a stop string cuts text, not steps)."""
        return sum(record.emitted for record in self.records)


class Engine:
    """Tokenizer, worker, connection pool and drafters of one `specbench serve`."""

    def __init__(self, settings: ServeSettings, log=print):
        from specbench.worker.client import RemoteTarget

        self.settings, self.log = settings, log
        self.router = self._load_router()  # a router serve cannot route with is refused before anything loads
        self._worker = self._stop_worker = None
        endpoint = settings.worker or self._start_worker()
        probe = RemoteTarget(endpoint)
        served = probe.info.get("model")
        if settings.worker and served is not None and label_model(served) != settings.target:
            raise SpecbenchError(f"the worker at {endpoint} serves {served!r}, not {settings.target!r}: start "
                                 f"serve with --target {label_model(served)}, or with no --target")
        # another process's worker brings its own tokenizer (no model files needed here); ours shares the name's
        self.tokenizer = probe.tokenizer if settings.worker else load_tokenizer(settings.target)
        probe.tokenizer = self.tokenizer
        self._clients: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(settings.limits.max_concurrent - 1):
            self._clients.put(RemoteTarget(endpoint, tokenizer=self.tokenizer))
        self.vocab_size, self.eos_token_ids = probe.vocab_size, probe.eos_token_ids
        self.target_device = target_device(probe)  # the worker's, as it reports it: what predictions are read for
        self._clients.put(probe)
        self._draft = self._load_draft()
        self._suffix = settings.suffix or SuffixSettings()
        offered = [name for name in settings.methods if name != AUTO]
        offered += [c.method for c in self.router.candidates if c.method not in offered] if self.router else []
        # free drafters by method; a head's by method and connection too: it reads the features its worker sends
        # over the connection it was built with (the connections are a fixed set, so the pools stay bounded)
        self._drafters: dict[tuple, queue.SimpleQueue] = defaultdict(queue.SimpleQueue)
        self._planners = self._build_planners()
        self.live = 0  # generations holding a worker session now (the tests count them)
        self._live_lock = threading.Lock()
        warm = (self.tokenizer("Hello, world.")["input_ids"] if self.tokenizer is not None else []) or [1, 2, 3]
        runs = [(name, Speculation(name, settings.k)) for name in settings.methods if name != AUTO]
        runs += [(f"auto's candidate {c.label}", Speculation(c.method, max(1, c.k)))
                 for c in (self.router.candidates if self.router else [])]
        for name, speculation in runs:  # every offered method runs here once: a bad one fails at start (its
            # drafter is built as for a request: a chain without --draft, a self-draft beside another process's
            # worker), and the first user does not pay the first forwards' set-up (seconds on a CPU)
            try:
                for _ in self.stream(Job(warm, 2, speculation), threading.Event()):
                    pass
            except SpecbenchError as error:
                self.close()
                raise SpecbenchError(f"method {name!r} cannot be served: {error}") from None

    # -- start and stop ----------------------------------------------------------------------------
    def _start_worker(self) -> str:
        from specbench.models.spec import ModelSpec
        from specbench.worker.launch import free_port
        from specbench.worker.server import Worker, WorkerConfig

        endpoint = f"tcp://127.0.0.1:{free_port()}"
        settings = self.settings
        config = WorkerConfig(bind=endpoint, device=settings.device,
                              model=ModelSpec(settings.target, dtype=settings.dtype, device=settings.device))
        self._worker = Worker(config, log=lambda line: self.log(f"worker: {line}"))
        stopped = threading.Event()
        self._stop_worker = stopped.set
        thread = threading.Thread(target=self._worker.serve, kwargs={"stop": stopped.is_set}, daemon=True,
                                  name="specbench-worker")
        thread.start()
        self._worker_thread = thread
        return endpoint

    def close(self) -> None:
        while True:
            try:
                self._clients.get_nowait().disconnect()
            except queue.Empty:
                break
        if self._stop_worker is not None:
            self._stop_worker()
            self._worker_thread.join(timeout=5)

    def _load_draft(self):
        """The draft model, loaded once; a draft head's folder as it is: its drafter loads and checks it against
        the worker's target (drafting here, it needs embeddings of its own: refused at start by name otherwise)."""
        if not self.settings.draft:
            return None
        from specbench.heads.profile import is_head
        from specbench.models.loading import load_model
        from specbench.models.spec import ModelSpec

        if is_head(self.settings.draft):
            return str(self.settings.draft)

        return load_model(ModelSpec(self.settings.draft, dtype=self.settings.dtype, device=self.settings.device))

    def _load_router(self):
        """Method auto's router, refused at start unless every candidate drafts here (serve drafts in its own
        process: a worker-only method has no place in it)."""
        if AUTO not in self.settings.methods:
            return None
        from specbench.route.router import Router

        router = Router.load(self.settings.router)
        stranded = [c.label for c in router.candidates if get_method(c.method).on_worker]
        if stranded:
            raise SpecbenchError(f"router {self.settings.router}: candidates {stranded} run wholly on a worker; serve "
                                 f"drafts in its own process: route with their client forms (suffix, chain, ...)")
        own = [c.label for c in router.candidates if c.draft is not None]
        if own:
            raise SpecbenchError(f"router {self.settings.router}: candidates {own} draft with a model of their own; "
                                 f"serve drafts with its --draft alone: route among candidates without '@DRAFT'")
        note = router.machine_note(self.settings.machine)
        if note:  # said once, at start: every request routes on this machine
            print(f"specbench serve: {note}", flush=True)
        return router

    def _route(self, prompt_ids: list[int], client, max_tokens: int) -> tuple[Speculation, dict]:
        """Method auto: the candidate the router predicts fastest for this prompt (what the server's suffix cache
        holds of it read as the router's seen share), and what to tell the client (with why the choice may not
        hold, where the request's length is far from the router's calibration's)."""
        from specbench.route.features import seen_share
        from specbench.route.router import predicted_speeds

        seen = seen_share(prompt_ids, self._memory(client)) if self.router.reads_seen else 0.0
        candidate, table = self.router.choose(prompt_ids, None, seen)
        chosen = Speculation(candidate.method, max(1, candidate.k))
        note = self.router.length_note(max_tokens)
        return chosen, {"chosen": candidate.label, "method": chosen.method, "k": chosen.k,
                        "route_predicted": predicted_speeds(table), **({"route_note": note} if note else {})}

    def _memory(self, client):
        """The server's cache of earlier outputs as auto's router reads and feeds it: none unless a candidate
        keeps outputs (calibration then gave the router 0), or the server keeps no shared cache."""
        from specbench.methods import suffix_cache

        return suffix_cache(self._source(client)) if self.router.keeps_outputs else None

    def _remember(self, client, output_ids: list[int]) -> None:
        """An auto request routed to a method without a suffix cache still leaves its output in the server's (as
        `run`'s auto and the router's calibration do): a later request that quotes it drafts from it."""
        memory = self._memory(client)
        if memory is not None and output_ids:
            memory.extend(memory.open(), list(output_ids))

    def _build_planners(self) -> dict:
        """With `plan`, a step planner per offered method a planner can steer, from the cached profiles
        and references (prompt lookup priced as lookup, a model draft as itself); a method without them
        is refused at start, naming what to record."""
        if not self.settings.plan:
            return {}
        from specbench.plan.predict import LOOKUP_DRAFT
        from specbench.plan.step_planner import planner_from_caches

        planners = {}
        for name in self.settings.methods:
            method = get_method(name) if name != AUTO else None
            if method is not None and method.plannable:
                drafted_by = LOOKUP_DRAFT if method.lookup else self.settings.draft
                if drafted_by is None:
                    raise SpecbenchError(f"--plan prices a chain drafted by --draft or by prompt lookup; method "
                                         f"{name!r} drafts otherwise: serve it without --plan")
                planners[name] = planner = planner_from_caches(self.settings.target, drafted_by,
                                                               dtype=self.settings.dtype, prefer=self.target_device,
                                                               where="remote" if self.settings.worker else "local")
                note = planner.profile_note(self.target_device, self.settings.dtype)
                if note:  # said once, at start: it steers every request
                    self.log(f"--plan, {name}: {note}")
        if not planners:
            raise SpecbenchError(f"--plan steers chain methods; none of {self.settings.methods} is one")
        return planners

    # -- pools -------------------------------------------------------------------------------------
    def _take_drafter(self, method: str, client, suffix: tuple = ()):
        """A free drafter of `method`, or a new one (drafters hold their own state; at most one per running
        generation is ever built). `client` is the caller's connection: the target it drafts for. A request
        with its own `suffix` knobs gets a drafter of its own, never pooled (requests choose any values: a pool
        per choice would grow without bound); the process-wide suffix cache is shared all the same."""
        if not suffix:
            try:
                return self._drafters[self._pool(method, client)].get_nowait()
            except queue.Empty:
                pass
        found = get_method(method)
        return found.build(self._source(client, suffix)) if found.build is not None else None

    @staticmethod
    def _pool(method: str, client) -> tuple:
        return (method, id(client)) if get_method(method).reads_features else (method,)

    def _source(self, client, suffix: tuple = ()) -> DraftSource:
        """What a request's drafter is built from (its suffix cache, where shared, is the server's)."""
        target_model = self._worker.ops.target.loaded if self._worker is not None else None
        settings = self.settings
        return DraftSource(client, target_model, self._draft, settings.dtype, settings.self_draft_layers,
                           settings.substitute_quantization, suffix=replace(self._suffix, **dict(suffix)),
                           stop_below=settings.stop_below)

    def _give_drafter(self, method: str, drafter, client, suffix: tuple = ()) -> None:
        if drafter is not None and not suffix:
            self._drafters[self._pool(method, client)].put(drafter)

    # -- one request -------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int]) -> list[int]:
        limit = self.settings.limits.max_prompt_tokens
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(prompt_ids) > limit:
            raise RequestError(f"the prompt is {len(prompt_ids)} tokens; this server takes at most {limit} "
                               f"(--max-prompt-tokens)", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
        return prompt_ids

    def stream(self, job: Job, cancelled: threading.Event) -> Iterator[Event]:
        """Run `job`, yielding an Event per step and a last one with the finish reason. Setting
        `cancelled` stops it at the next step and frees its worker session."""
        client, drafter, speculation, route = self._clients.get(), None, job.speculation, None
        steps = None
        try:
            if speculation.method == AUTO:
                speculation, route = self._route(job.prompt_ids, client, job.max_tokens)
            method = get_method(speculation.method)
            drafter = self._take_drafter(method.name, client, speculation.suffix)
            planner = copy.deepcopy(self._planners[method.name]) if method.name in self._planners else None
            decoding = Decoding(speculation.k if method.kind != "none" else 0, job.max_tokens,
                                request_sampling(job.sampling, method, routed=route is not None),
                                method.name, method.kind, planner)
            seed = job.seed if job.seed is not None else random.getrandbits(62)
            with self._live_lock:
                self.live += 1
            steps = generate_steps(client, drafter, job.prompt_ids, decoding, seed=seed,
                                   session=f"serve-{uuid.uuid4().hex[:12]}")
            text = TextStream(self.tokenizer, job.stop)
            records = []
            while True:
                if cancelled.is_set():
                    yield Event(finish_reason="cancelled", records=records, route=route)
                    return
                try:
                    record = next(steps)
                except StopIteration as done:
                    if route is not None and not method.keeps_outputs:
                        self._remember(client, done.value.output_ids)
                    finish = "stop" if done.value.output_ids and done.value.output_ids[-1] in self.eos_token_ids \
                        else "length"
                    yield Event(pieces=text.flush(), finish_reason=finish, records=records,
                                prefill_s=done.value.prefill_s, route=route)
                    return
                if record is None:
                    continue
                records.append(record)
                sources = ["draft"] * min(record.accepted, record.emitted)
                sources += ["target"] * (record.emitted - len(sources))
                pieces, stopped = text.add(record.emitted_tokens, sources)
                if stopped:
                    yield Event(pieces=pieces)
                    yield Event(finish_reason="stop", records=records, route=route)
                    return
                yield Event(pieces=pieces)
        except RequestError:
            raise
        except SpecbenchError as error:
            status, code = http_status(error)
            raise RequestError(str(error), status=status, code=code) from error
        finally:
            if steps is not None:
                steps.close()  # closes the worker session
                with self._live_lock:
                    self.live -= 1
            if drafter is not None:
                self._give_drafter(method.name, drafter, client, speculation.suffix)
            self._clients.put(client)


def request_sampling(sampling: SamplingParams, method, routed: bool) -> SamplingParams:
    """A sampled request's rule: sample-match (the target draws each position from the seed alone, so
    a seed gives the same text under every method and whatever the shared suffix cache holds) for
    target-only, lookup drafts, drafts that read the cache and routed requests; rejection for a draft
    model's own drafts, where it accepts more (sum min(p, q) against sum p*q) and the drafts depend on
    the request alone. For a lookup draft (q one point) both rules accept p(x): nothing is lost. A
    dynamic tree (`method.rejection` False) has no rejection rule: sample-match, its children coupled."""
    if sampling.greedy or not (method.kind == "none" or method.lookup or method.keeps_outputs or routed
                               or not method.rejection):
        return sampling
    return replace(sampling, rule="sample-match")


# A worker's refusal, as the HTTP status a client can act on (worker/server.py's ERROR_CODES)
WORKER_STATUS = {"limit": (400, "invalid_request_error"), "bad-request": (400, "invalid_request_error"),
                 "model-changed": (409, "model_changed"), "refused": (409, "model_changed")}


def http_status(error: SpecbenchError) -> tuple[int, str]:
    """(status, code) for an error raised while generating: a worker's refusal by its code, a worker
    that does not answer 503, anything else 500."""
    from specbench.worker.client import WorkerError, WorkerUnavailableError

    if isinstance(error, WorkerUnavailableError):
        return 503, "worker_unavailable"
    if isinstance(error, WorkerError):
        return WORKER_STATUS.get(error.code, (500, "server_error"))
    return 500, "server_error"
