"""The HTTP face of `specbench serve`: OpenAI's routes, server-sent events, /metrics and the chat page.

Generation is blocking torch work, so each request runs in a thread of a pool sized like the
engine's (`max_concurrent`); steps come back to the event loop through a queue. A client that
disconnects mid-stream cancels its generation at the next step, which closes its worker session.
Beyond `max_concurrent` running and `max_queue` waiting, a request gets 429 with Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specbench.methods import get_method
from specbench.serve.engine import Engine, Event, Job
from specbench.serve.metrics import CONTENT_TYPE, ServeMetrics
from specbench.serve.requests import chat_job, check_model, completion_job, error_body
from specbench.serve.settings import RequestError
from specbench.types import StepRecord

TIMING_FIELDS = ("draft_s", "queue_s", "verify_s", "target_forward_s", "network_s", "overhead_s", "step_s")


class Busy(RequestError):
    def __init__(self, message: str):
        super().__init__(message, None, status=429, code="rate_limit_exceeded")


def create_app(engine: Engine, predictions: Optional[dict] = None) -> FastAPI:
    settings = engine.settings
    limits, served = settings.limits, settings.target
    metrics = ServeMetrics(served)
    pool = ThreadPoolExecutor(max_workers=limits.max_concurrent, thread_name_prefix="specbench-serve")
    admitted = {"running": 0, "waiting": 0}
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specbench serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.admitted = engine, metrics, admitted
    slots = asyncio.Semaphore(limits.max_concurrent)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError):
        headers = {"Retry-After": str(limits.retry_after_s)} if error.status == 429 else None
        return JSONResponse(error_body(str(error), error.param, error.code), status_code=error.status,
                            headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return JSONResponse(error_body(str(error.detail), code="not_found" if error.status_code == 404 else
                                       "invalid_request_error"), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return JSONResponse(error_body(str(error)), status_code=400)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {settings.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise RequestError("a valid API key is needed (Authorization: Bearer ...)", status=401,
                               code="invalid_api_key")

    async def read_body(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            raise RequestError(f"the body is over {limits.max_body_bytes} bytes", status=413, code="too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_body_bytes:
                raise RequestError(f"the body is over {limits.max_body_bytes} bytes", status=413, code="too_large")
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError) as error:
            raise RequestError(f"the body is not valid JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise RequestError("the body must be a JSON object")
        return parsed

    def admit() -> None:
        """Count the request as waiting, or refuse it when every slot and queue place is taken."""
        if admitted["running"] + admitted["waiting"] >= limits.max_concurrent + limits.max_queue:
            raise Busy(f"{admitted['running']} requests running and {admitted['waiting']} waiting "
                       f"(--max-concurrent {limits.max_concurrent}, --max-queue {limits.max_queue}); retry later")
        admitted["waiting"] += 1
        metrics.waiting.labels(served).inc()

    async def events_of(job: Job) -> AsyncIterator[Event]:
        """The engine's events for an admitted `job`, run in the pool; leaving early cancels it."""
        loop, queue, cancelled = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        try:
            await slots.acquire()
        finally:
            admitted["waiting"] -= 1
            metrics.waiting.labels(served).dec()
        admitted["running"] += 1
        metrics.running.labels(served).inc()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed (shutdown)
                pass

        def work() -> None:
            try:
                for event in engine.stream(job, cancelled):
                    put(event)
            except Exception as error:  # noqa: BLE001  (handed to the request, which answers it)
                put(error)
            finally:
                put(None)
                try:
                    loop.call_soon_threadsafe(slots.release)  # the slot frees when the generation has stopped
                except RuntimeError:
                    pass

        pool.submit(work)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            cancelled.set()
            # done as far as its client can tell: a next request is admitted, and waits the moment the
            # thread takes to close the session (it holds the slot until then)
            admitted["running"] -= 1
            metrics.running.labels(served).dec()

    async def completion(request: Request, chat: bool):
        authorize(request)
        body = await read_body(request)
        check_model(body, served)
        make = chat_job if chat else completion_job
        job, stream, include_usage = make(body, settings, engine.tokenizer, engine)
        answer = Answer(job, chat, served, metrics, settings.tune_note(job.speculation.method, job.max_tokens))
        admit()
        if stream:
            return StreamingResponse(answer.sse(events_of(job), include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for event in events_of(job):
            answer.take(event)
        payload = answer.whole()
        return JSONResponse(payload, headers={"x-specbench-timing": json.dumps(payload["specbench"]["timing"])})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "specbench"}]}

    @app.get("/specbench/settings")
    async def offered(request: Request):
        authorize(request)
        return {"model": served, "methods": list(settings.methods), "k": settings.k, "max_k": settings.max_k,
                "router": [c.label for c in engine.router.candidates] if engine.router else None,
                "draft": settings.draft, "plan": settings.plan, "predicted": predictions or {},
                "target_device": engine.target_device,
                "live_sessions": engine.live}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("specbench.serve").joinpath("chat.html").read_text()

    return app


class Answer:
    """One response, built from engine events: the text, the usage with SD figures, the timing split."""

    def __init__(self, job: Job, chat: bool, model: str, metrics: ServeMetrics, tune_note: Optional[str] = None):
        self.job, self.chat, self.model, self.metrics, self.tune_note = job, chat, model, metrics, tune_note
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text, self.started = "", time.perf_counter()
        self.first_token_s: Optional[float] = None
        self.finish: Optional[str] = None
        self.end: Optional[Event] = None

    def take(self, event: Event) -> str:
        """Fold an event in; returns the text it added."""
        added = "".join(piece.text for piece in event.pieces)
        if added and self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started
        self.text += added
        if event.finish_reason is not None:
            self.finish, self.end = event.finish_reason, event
            e2e = time.perf_counter() - self.started
            self.metrics.observe(event.records, len(self.job.prompt_ids), event.completion_tokens,
                                 self.first_token_s or e2e, e2e, event.finish_reason)
        return added

    def usage(self) -> dict:
        records, generated = self.end.records, self.end.completion_tokens
        drafted = sum(r.drafted for r in records)
        accepted = sum(r.accepted for r in records)
        asked, route = self.job.speculation, self.end.route
        ran, k = (route["method"], route["k"]) if route else (asked.method, asked.k)  # auto: what its router chose
        speculative = {"method": asked.method, "k": 0 if get_method(ran).kind == "none" else k,
                       "steps": len(records), "planned": any(r.planned for r in records),
                       "drafted_tokens": drafted, "accepted_tokens": accepted,
                       "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                       "tokens_per_step": round(generated / len(records), 4) if records else None,
                       "target_forwards": len(records) + 1}  # each step's verify plus the prefill
        if route is not None:
            speculative.update({key: route[key] for key in ("chosen", "route_predicted", "route_note") if key in route})
        if self.job.speculation.suffix:
            speculative["suffix"] = dict(self.job.speculation.suffix)
        if self.tune_note:
            speculative["tune_note"] = self.tune_note
        return {"prompt_tokens": len(self.job.prompt_ids), "completion_tokens": generated,
                "total_tokens": len(self.job.prompt_ids) + generated, "speculative": speculative}

    def summary(self) -> dict:
        """The per-step timing split the records hold, summed over the request (seconds)."""
        records = self.end.records
        timing = {name: round(sum(getattr(r, name) for r in records), 6) for name in TIMING_FIELDS}
        timing["prefill_s"] = round(self.end.prefill_s, 6)
        return {"timing": timing, "steps": [_step(r) for r in records]}

    def whole(self) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "finish_reason": self.finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": self.finish, "logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(),
                "specbench": self.summary()}

    def chunk(self, text: Optional[str], pieces, finish: Optional[str] = None, first: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "specbench": {"pieces": [[p.text, p.source] for p in pieces]}}

    async def sse(self, events: AsyncIterator[Event], include_usage: bool) -> AsyncIterator[str]:
        first = True
        try:
            async for event in events:
                added = self.take(event)
                if added or first:
                    yield _data(self.chunk(added, event.pieces, first=first))
                    first = False
                if event.finish_reason is not None:
                    last = self.chunk(None if self.chat else "", [], finish=self.finish)
                    last["specbench"] = self.summary()
                    yield _data(last)
                    if include_usage:
                        yield _data({"id": self.id, "object": "chat.completion.chunk" if self.chat else
                                     "text_completion", "created": self.created, "model": self.model,
                                     "choices": [], "usage": self.usage()})
        except RequestError as error:
            yield _data(error_body(str(error), error.param, error.code))
        yield "data: [DONE]\n\n"


def _step(record: StepRecord) -> dict:
    return {"k": record.step_k, "drafted": record.drafted, "accepted": record.accepted, "emitted": record.emitted,
            **{name: round(getattr(record, name), 6) for name in TIMING_FIELDS}}


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
