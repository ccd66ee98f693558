"""Long requests as jobs the worker advances a slice at a time between other clients' batches.

Why: a shared target that ran a 4,000-token prefill, a 1,000-token server-only generate or a
profile grid in one go would hold every other client's step for that long. A job is a generator
that does one bounded slice per `next()` (a prefill chunk, a generate step, a profile piece: one
forward of at most `--slice-tokens` new tokens) and returns its `(reply, arrays)`. Between rounds of
verifies the scheduler advances one slice at a time, round robin between tenants (principals), each
tenant's jobs in the order they came: a tenant with eight long requests gets no more turns than a
tenant with one.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

from specbench.types import SpecbenchError


class CancelledError(SpecbenchError):
    """The request's session was closed or expired before the request finished."""


@dataclass
class Job:
    steps: Generator[Any, None, tuple]
    session_key: Optional[str] = None  # the target session it builds, if any
    key: Optional[tuple] = None  # the request key (a resend of the same request joins the job)
    principal: str = ""  # whose quota it counts against (generates and profiles)
    prefill: Any = None  # a prefill's `PrefillJob`: its chunks may also ride in verify batches
    op: str = "job"  # what it does ("prefill", "generate", "profile"): the key its slices' time is counted under
    busy: Optional[Callable[[str, float], None]] = None  # told each slice's seconds (the worker's `Stats.add_busy`)
    waiters: list = field(default_factory=list)  # the messages its reply goes to
    started: Optional[float] = None  # when its first slice ran (the end of its queueing)
    result: Any = None  # (reply, arrays) or an exception, once done
    done: bool = False

    def advance(self) -> bool:
        """Run one slice; True once the job has its result (or failed)."""
        if self.done:
            return True
        sliced = time.perf_counter()
        if self.started is None:
            self.started = sliced
        try:
            next(self.steps)
            return False
        except StopIteration as finished:
            self.result, self.done = finished.value, True
        except Exception as error:  # the job's failure is its waiters' error reply
            self.result, self.done = error, True
        finally:
            if self.busy is not None:
                self.busy(self.op, time.perf_counter() - sliced)
        return True

    def cancel(self, error: Exception) -> None:
        if not self.done:
            self.steps.close()  # runs the job's own clean-up (finally blocks)
            self.result, self.done = error, True


class JobQueue:
    def __init__(self):
        self.jobs: list[Job] = []
        self._turns: list[str] = []  # principals in the order their next turn comes

    def __len__(self) -> int:
        return sum(not job.done for job in self.jobs)

    def add(self, job: Job) -> None:
        self.jobs.append(job)

    def for_session(self, session_key: str) -> Optional[Job]:
        return next((job for job in self.jobs if job.session_key == session_key and not job.done), None)

    def sessions(self) -> set[str]:
        return {job.session_key for job in self.jobs if job.session_key and not job.done}

    def cancel(self, session_key: str, error: Exception) -> None:
        job = self.for_session(session_key)
        if job is not None:
            job.cancel(error)

    def cancel_all(self, error: Exception) -> None:
        for job in self.jobs:
            job.cancel(error)

    def advance_one(self) -> None:
        """One slice of the oldest unfinished job of the tenant whose turn it is.

        Example: tenant A has jobs a1, a2 and tenant B has b1: slices go a1, b1, a1, b1, ... then a2."""
        pending = [job for job in self.jobs if not job.done]
        if not pending:
            return
        waiting = list(dict.fromkeys(job.principal for job in pending))
        self._turns = [p for p in self._turns if p in waiting] + [p for p in waiting if p not in self._turns]
        principal = self._turns.pop(0)
        self._turns.append(principal)
        next(job for job in pending if job.principal == principal).advance()

    def prefills(self) -> list[Job]:
        """Unfinished prefill jobs with prompt tokens left to feed, oldest first."""
        return [job for job in self.jobs if job.prefill is not None and not job.done and job.prefill.remaining]

    def take_finished(self) -> list[Job]:
        finished = [job for job in self.jobs if job.done]
        self.jobs = [job for job in self.jobs if not job.done]
        return finished


class ReplyStore:
    """The last few finished replies of long requests, per tenant, keyed by `(op, principal, name, digest)`:
    a client that resends a generate after a timeout gets the reply of the run it already paid for,
    instead of starting a second one. Bounded per tenant and in all; the oldest go first."""

    def __init__(self, per_principal: int = 4, total: int = 64):
        self.per_principal, self.total = per_principal, total
        self._replies: OrderedDict[tuple, tuple] = OrderedDict()

    def __contains__(self, key: tuple) -> bool:
        return key in self._replies

    def __getitem__(self, key: tuple) -> tuple:
        return self._replies[key]

    def store(self, key: tuple, reply: dict, arrays: dict) -> None:
        self._replies[key] = (reply, arrays)
        mine = [k for k in self._replies if k[1] == key[1]]
        for old in mine[:-self.per_principal]:
            del self._replies[old]
        while len(self._replies) > self.total:
            self._replies.popitem(last=False)
