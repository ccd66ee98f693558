"""The speculative loop: prefill, then per step ask the budget, speculate, cut at EOS or the limit, record.

Target-only decoding is the same loop with no drafter.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Sequence

from specbench.decode.drafters import Drafter
from specbench.decode.records import record_step
from specbench.decode.step import Step, speculative_step
from specbench.decode.target import Target
from specbench.sampling.streams import Streams
from specbench.types import SamplingParams, SpecbenchError, StepRecord


@dataclass(frozen=True)
class Decoding:
    """How one method decodes every prompt of a run.

    `k` is the draft size per step (chain tokens, or tree nodes); a `planner` (anything with
    `choose(context_length) -> k` and `observe(drafted, accepted, network_s, batch_size)`, e.g.
    `specbench.plan.step_planner.StepPlanner`) picks it afresh per step up to `k`, 0 making that
    step a plain target step. `method` and `kind` label the records.
    """

    k: int
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    method: str = ""
    kind: str = "chain"
    planner: Optional[Any] = None

    def __post_init__(self):
        if self.k < 1 and self.kind != "none":
            raise SpecbenchError(f"k (draft tokens per step) must be >= 1, got {self.k}")
        if self.max_new_tokens < 1:
            raise SpecbenchError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Generation:
    prompt_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    prefill_s: float
    records: list[StepRecord]


def generate(target: Target, drafter: Optional[Drafter], prompt_ids: Sequence[int], decoding: Decoding, *,
             seed: int = 0, prompt_index: int = 0, session: str = "default",
             step: Callable[..., Step] = speculative_step) -> Generation:
    """Generate up to `decoding.max_new_tokens` tokens, stopping after one of the target's EOS ids.

    Tokens past an EOS or the limit are dropped even when accepted, so the output is exactly what
    target-only decoding returns. The depth is capped at remaining - 1 (the bonus token supplies the
    last one); a tree keeps its node budget, so its siblings survive the cap.
    """
    return run_to_end(generate_steps(target, drafter, prompt_ids, decoding, seed=seed, prompt_index=prompt_index,
                                     session=session, step=step))


def generate_steps(target: Target, drafter: Optional[Drafter], prompt_ids: Sequence[int], decoding: Decoding, *,
                   seed: int = 0, prompt_index: int = 0, session: str = "default",
                   step: Callable[..., Step] = speculative_step,
                   prefill_chunk: Optional[int] = None) -> Generator[Optional[StepRecord], None, Generation]:
    """`generate`, pausing after each step (yielding its record): a shared worker runs a server-only
    generation a step at a time between other clients' batches. Closing it closes the session.
    `prefill_chunk` (a `LocalTarget`): the prompt goes in that many tokens per pause (yielding None),
    through the target and a drafter that can `warm` its cache, so no pause holds a whole long prompt."""
    streams = Streams(seed, coupled=decoding.sampling.effective_rule == "sample-match")
    planner = decoding.planner if drafter is not None else None
    if hasattr(drafter, "bind"):  # a drafter that reads the target's session (a draft head, `heads/`)
        drafter.bind(target, session)
    if prefill_chunk:
        prefill_s = yield from _prefill_in_chunks(target, drafter, session, list(prompt_ids), prefill_chunk)
    else:
        started = time.perf_counter()
        target.prefill(session, prompt_ids)
        prefill_s = time.perf_counter() - started
    context, records = list(prompt_ids), []
    try:
        while (remaining := decoding.max_new_tokens - (len(context) - len(prompt_ids))) > 0:
            step_k = 0 if drafter is None else min(decoding.k, planner.choose(len(context)) if planner else decoding.k)
            started = time.perf_counter()
            result = step(target, drafter, session, context, step_k, remaining - 1, decoding.sampling, streams)
            if planner is not None:
                timing = result.verdict.timing
                planner.observe(len(result.tree), len(result.verdict.accepted_path), timing.network_s, timing.batch_size)
            emitted, finished = _cut(result.verdict.emitted(result.tree), target.eos_token_ids, remaining)
            context += emitted
            records.append(record_step(result, emitted, prompt_index=prompt_index, index=len(records),
                                       method=decoding.method, kind=decoding.kind, planned=planner is not None,
                                       step_k=step_k, step_s=time.perf_counter() - started))
            yield records[-1]
            if finished:
                break
    finally:
        target.close(session)
        if hasattr(drafter, "finish"):  # a drafter that keeps outputs (suffix decoding's cache) takes the last tokens
            drafter.finish(context)
    return Generation(prompt_index, list(prompt_ids), context[len(prompt_ids):], prefill_s, records)


def _prefill_in_chunks(target, drafter, session: str, prompt_ids: list[int], chunk: int) -> Generator[None, None, float]:
    """Feed the prompt `chunk` tokens per pause; returns the seconds spent feeding (not pausing)."""
    job, seconds = target.prefill_job(session, prompt_ids), 0.0
    warm = getattr(drafter, "warm", None)
    while True:
        started = time.perf_counter()
        done = job.advance(chunk)
        seconds += time.perf_counter() - started
        if done:
            break
        yield None
    while warm is not None:
        started = time.perf_counter()
        done = warm(prompt_ids, chunk)
        seconds += time.perf_counter() - started
        if done:
            break
        yield None
    return seconds


def run_to_end(steps: Generator) -> Any:
    """Drive a step generator to its end and return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _cut(emitted: list[int], eos_token_ids: Sequence[int], remaining: int) -> tuple[list[int], bool]:
    """The emitted tokens up to and including the first EOS, and at most `remaining` of them."""
    for index, token in enumerate(emitted[:remaining]):
        if token in eos_token_ids:
            return emitted[:index + 1], True
    return emitted[:remaining], False
