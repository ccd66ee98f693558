"""Clients sharing one batching worker, simulated event by event.

Why: a loaded step is not a lock-step round (every client drafts, then one batched verify). On a CPU a
1.5B verify takes 0.3-0.9 s and a model draft 0.1-0.5 s; once the clients drift apart, a verify arrives
while the worker is busy with another's and waits, and the worker runs whatever has arrived when it is
free. Priced as lock-step, the Qwen pair's loaded points through a worker were over-predicted by a median
31-78% (benchmarks/results/2026-11-27-tune-qwen-worker.md). This replays each client's steps against the
worker's own batching rule (`worker/server.py`'s `_drain`): the first waiting request opens a batch, which
takes every request waiting, then waits at least `window_s`, and for a session expected back (its last
reply + its last turnaround) up to `wait_cap_s`; prefills ride in the next batch up to `slice_tokens`
tokens, or run a slice alone when no verify waits.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from statistics import mean
from typing import Callable, Sequence

from specbench.plan.predict import HostCost


@dataclass(frozen=True)
class ClientStep:
    think_s: float  # the client's own time before it sends the step: drafting, its loop, the wire both ways
    width: int  # tokens the verify computes: 1 + drafted
    emitted: int  # tokens the step commits
    context: int  # tokens already cached for the session when the step is verified


@dataclass(frozen=True)
class ClientPrompt:
    prompt_tokens: int
    prefill_s: float  # the prompt's prefill alone on the worker
    steps: tuple[ClientStep, ...]


@dataclass(frozen=True)
class WorkerRules:
    # seconds of one batched forward: (mean tokens per row, mean context, rows) -> seconds
    forward_s: Callable[[float, int, int], float]
    host: HostCost = HostCost()  # the worker's own work per round, at its rows
    window_s: float = 0.020  # `--batch-window-ms`
    wait_cap_s: float = 0.0  # `--batch-wait-ms` (auto: a forward's fixed cost)
    max_batch: int = 16
    slice_tokens: int = 256


@dataclass
class Simulated:
    tokens: int = 0
    step_s: float = 0.0  # the clients' step times summed: from a step's start to its reply
    rows: list = field(default_factory=list)  # rows of each verify round
    queue_s: list = field(default_factory=list)  # each step's wait in the worker before its round ran
    busy_s: float = 0.0  # the verify rounds' seconds (prefill chunks riding in them included)
    riding_s: float = 0.0  # of which the prefill chunks riding in them
    seconds: float = 0.0  # until the last client finished

    @property
    def tokens_per_s(self) -> float:
        """Per client, as a run's records give it: emitted tokens over the steps' wall time."""
        return self.tokens / self.step_s if self.step_s else 0.0

    @property
    def mean_rows(self) -> float:
        return mean(self.rows) if self.rows else 0.0


def simulate(clients: Sequence[Sequence[ClientPrompt]], worker: WorkerRules) -> Simulated:
    """Every client decodes its prompts one after another (a prefill, then its steps), all starting at 0."""
    out = Simulated()
    cursor = [[0, -1] for _ in clients]  # per client: prompt index, step index (-1: its prefill)
    arrivals: list = []  # (time, order, client) of requests not yet arrived at the worker
    waiting: dict[int, float] = {}  # verifies arrived: client -> arrival time
    prefills: list = []  # [client, tokens left, seconds per token, arrival, none fed yet], oldest first
    replied: dict[int, list] = {}  # client -> [its last reply, its last turnaround (reply to next arrival)]
    sent: dict[int, float] = {}  # client -> when its current step started (its previous reply)
    order = 0

    def send(client: int, now: float) -> None:
        nonlocal order
        prompt_index, step_index = cursor[client]
        if prompt_index >= len(clients[client]):
            return
        prompt = clients[client][prompt_index]
        think = prompt.steps[step_index].think_s if step_index >= 0 else 0.0
        sent[client] = now
        heapq.heappush(arrivals, (now + think, order, client))
        order += 1

    for client in range(len(clients)):
        send(client, 0.0)
    clock = 0.0
    while arrivals or waiting or prefills:
        if not waiting and not prefills:
            clock = max(clock, arrivals[0][0])
        _arrive(arrivals, clock, clients, cursor, waiting, prefills, replied)
        if waiting or any(entry[4] for entry in prefills):  # a request came: the worker gathers a batch
            clock = _gather(clock, arrivals, clients, cursor, waiting, prefills, replied, worker)
        if waiting:
            batch = sorted(waiting, key=waiting.get)[:worker.max_batch]
            steps = [clients[c][cursor[c][0]].steps[cursor[c][1]] for c in batch]
            seconds = worker.forward_s(mean(s.width for s in steps), round(mean(s.context for s in steps)), len(steps))
            riding = _ride(prefills, worker.slice_tokens)
            seconds += worker.host.at(len(steps)) + riding
            out.rows.append(len(steps))
            out.busy_s += seconds
            out.riding_s += riding
            out.queue_s += [clock - waiting[c] for c in batch]
            clock += seconds
            for client, step in zip(batch, steps):
                del waiting[client]
                out.tokens += step.emitted
                out.step_s += clock - sent[client]
                replied[client] = [clock, replied.get(client, [0.0, None])[1]]
                cursor[client][1] += 1
                _advance(clients, cursor, client)
                send(client, clock)
        else:
            clock += _ride(prefills, worker.slice_tokens)
        for client in _prefilled(prefills, clients, cursor):
            send(client, clock)
    out.seconds = clock
    return out


def _arrive(arrivals, clock, clients, cursor, waiting, prefills, replied) -> None:
    """Requests that reached the worker by `clock` join the verifies or the prefills waiting there."""
    while arrivals and arrivals[0][0] <= clock:
        at, _, client = heapq.heappop(arrivals)
        prompt = clients[client][cursor[client][0]]
        if cursor[client][1] < 0:
            prefills.append([client, prompt.prompt_tokens, prompt.prefill_s / max(prompt.prompt_tokens, 1), at, True])
        else:
            waiting[client] = at
            if client in replied:
                replied[client][1] = at - replied[client][0]


def _gather(clock, arrivals, clients, cursor, waiting, prefills, replied, worker: WorkerRules) -> float:
    """When the batch opened at `clock` closes: while fewer requests wait (verifies, prefills not yet fed) than
    sessions are in use, until each one expected back within the cap has come (the worker's estimate: its
    last reply + its last turnaround; a client that has just sent its next prompt's prefill counts, as its
    last session stays in use until its close is read with it), or the cap passes; at least the window."""
    started = clock
    expected = [started if turnaround is None or cursor[client][1] < 0 else reply + turnaround
                for client, (reply, turnaround) in replied.items() if cursor[client][0] < len(clients[client])]
    wait = max(worker.window_s, worker.wait_cap_s)
    horizon = started + wait if wait > worker.window_s else float("inf")
    expected = [t for t in expected if t <= horizon]
    deadline = max([started + worker.window_s]
                   + [min(t + worker.window_s + 0.25 * max(0.0, t - started), started + wait) for t in expected])
    requests = lambda: len(waiting) + sum(entry[4] for entry in prefills)  # noqa: E731
    while requests() < max(len(expected), 1) and arrivals and arrivals[0][0] <= deadline:
        clock = max(clock, arrivals[0][0])
        _arrive(arrivals, clock, clients, cursor, waiting, prefills, replied)
    if requests() < max(len(expected), 1):
        clock = max(clock, deadline)
    _arrive(arrivals, clock, clients, cursor, waiting, prefills, replied)
    return clock


def _ride(prefills: list, budget: int) -> float:
    """Seconds of the prefill tokens fed this round, oldest prefill first, up to `budget` tokens."""
    seconds = 0.0
    for entry in prefills:
        if budget <= 0:
            break
        tokens = min(budget, entry[1])
        entry[1] -= tokens
        entry[4] = False
        seconds += tokens * entry[2]
        budget -= tokens
    return seconds


def _prefilled(prefills: list, clients, cursor) -> list[int]:
    """Clients whose prefill finished: each moves to its first step."""
    done = [entry[0] for entry in prefills if entry[1] <= 0]
    prefills[:] = [entry for entry in prefills if entry[1] > 0]
    for client in done:
        cursor[client][1] = 0
        _advance(clients, cursor, client)
    return done


def _advance(clients, cursor, client: int) -> None:
    """Past a prompt's last step: the next prompt, starting with its prefill."""
    prompt_index, step_index = cursor[client]
    if prompt_index < len(clients[client]) and step_index >= len(clients[client][prompt_index].steps):
        cursor[client][0], cursor[client][1] = prompt_index + 1, -1
