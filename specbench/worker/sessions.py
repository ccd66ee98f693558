"""Sessions on a shared worker: who owns them, which step they are at, and what a repeat gets.

Why each rule exists (each was a silently wrong output before):
- Ownership: a session lives in its owner's namespace (CURVE public key + the client's secret
  token), so a client that learns another's session name finds nothing there.
- Steps: every state-changing request names the state it expects, `epoch` (the client's prefill
  count) and `committed` (its committed length). The worker applies a step exactly once; the same
  request again (a resend after a timeout, or the abandoned copy of one) gets the stored reply;
  any other mismatch is refused as stale. Example: verify (epoch 1, committed 8) applied -> the
  session is at (1, 11); the resent verify (1, 8) with the same content gets the stored verdict;
  a verify (1, 9) is stale.
- Model changes end sessions with a reason that the next request on them receives.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Optional

from specbench.types import SpecbenchError
from specbench.worker.limits import WorkerLimits, check


class UnknownSessionError(SpecbenchError):
    """No such session in the caller's namespace (never opened, expired, or the worker restarted)."""


class StaleStepError(SpecbenchError):
    """A request for a state the session is no longer (or not yet) in."""


class SessionEndedError(SpecbenchError):
    """The session ended for a reason its owner must see (e.g. the worker's model changed)."""


@dataclass
class Session:
    owner: str
    name: str
    principal: str  # who the quota counts against: the CURVE key, else the client token
    connection: bytes  # the connection that opened it, for the per-connection quota
    model: str  # identity of the model the session was opened on
    key: str  # the target's own session key (owner digest + name; never the secret itself)
    epoch: int = 0
    committed: int = 0
    last_used: float = field(default_factory=time.monotonic)
    replay: Optional[tuple] = None  # (request key, reply, arrays) of the last applied step
    ended: Optional[str] = None
    # the client's side of a step, as the scheduler sees it: when its last verify reply went out
    # (perf_counter), and how long, smoothed, the client takes from a reply to its next verify (drafting,
    # network): when it is expected back, so a batch can wait for a drafting client rather than split
    replied_at: Optional[float] = None
    turnaround_s: Optional[float] = None
    feature_dtype: Optional[str] = None  # a client-side draft head's: the features of each step travel back

    def arrived(self, received: float) -> None:
        """A verify from this session arrived at `received`: one more turnaround sample."""
        if self.replied_at is not None:
            sample = max(0.0, received - self.replied_at)
            self.turnaround_s = sample if self.turnaround_s is None else 0.7 * self.turnaround_s + 0.3 * sample
        self.replied_at = None


def request_key(op: str, epoch: int, committed: int, header: dict, arrays: dict) -> tuple:
    """What makes two requests the same step: op, expected state, and a digest of their content."""
    digest = hashlib.sha256(repr(sorted((k, v) for k, v in header.items()
                                        if k in ("sampling", "seed"))).encode())
    for name in sorted(arrays):
        digest.update(name.encode() + arrays[name].tobytes())
    return op, epoch, committed, digest.hexdigest()


class SessionTable:
    def __init__(self, limits: WorkerLimits):
        self.limits = limits
        self.sessions: dict[tuple[str, str], Session] = {}

    def __len__(self) -> int:
        return sum(1 for s in self.sessions.values() if s.ended is None)

    def find(self, owner: str, name: str) -> Session:
        session = self.sessions.get((owner, name))
        if session is None:
            raise UnknownSessionError(f"unknown session {name!r} for this client: prefill it first "
                                      f"(it may have expired, or the worker restarted)")
        if session.ended is not None:
            raise SessionEndedError(f"session {name!r} ended: {session.ended}")
        session.last_used = time.monotonic()
        return session

    def admit(self, owner: str, name: str, principal: str, connection: bytes, model: str) -> Session:
        """The caller's session `name`, created if new and the quotas allow it."""
        existing = self.sessions.get((owner, name))
        if existing is not None and existing.ended is None:
            existing.last_used, existing.replied_at = time.monotonic(), None  # a new prompt: no step out
            return existing
        live = [s for s in self.sessions.values() if s.ended is None]
        check(len(live) + 1, self.limits.max_sessions, "open sessions", "--max-sessions")
        check(sum(s.principal == principal for s in live) + 1, self.limits.max_sessions_per_client,
              "open sessions of this client", "--max-sessions-per-client")
        check(sum(s.connection == connection for s in live) + 1, self.limits.max_sessions_per_client,
              "open sessions of this connection", "--max-sessions-per-client")
        key = f"{hashlib.sha256(owner.encode()).hexdigest()[:12]}/{name}"
        session = Session(owner, name, principal, connection, model, key)
        self.sessions[(owner, name)] = session
        return session

    def remove(self, owner: str, name: str) -> Optional[Session]:
        return self.sessions.pop((owner, name), None)

    def awaited(self, within_s: float, horizon: float, excluding: frozenset = frozenset()) -> list[float]:
        """When (perf_counter) each session the next batch could wait for is expected to send its step: the
        live sessions used within `within_s` with no prefill under way (`excluding`, target keys). One
        with a reply out and a turnaround known is expected at reply + turnaround, and left out if that
        is after `horizon` (the batch will not wait so long); any other, now."""
        now, clock = time.monotonic(), time.perf_counter()
        out = []
        for s in self.sessions.values():
            if s.ended is not None or now - s.last_used > within_s or s.key in excluding:
                continue
            if s.replied_at is None or s.turnaround_s is None:
                out.append(clock)
            elif s.replied_at + s.turnaround_s <= horizon:
                out.append(s.replied_at + s.turnaround_s)
        return out

    def live(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.ended is None]

    def end(self, sessions: list[Session], reason: str) -> None:
        for session in sessions:
            session.ended, session.replay = reason, None

    def idle(self, timeout_s: float) -> list[Session]:
        now = time.monotonic()
        return [s for s in self.sessions.values() if now - s.last_used > timeout_s]


def check_step(session: Session, key: tuple) -> Optional[tuple[dict, dict]]:
    """None if `key` is the next step to apply; the stored reply if it repeats the last applied one;
    StaleStepError otherwise. Prefill (a new epoch) is next when its epoch is above the session's."""
    op, epoch, committed, _ = key
    if session.replay is not None and session.replay[0] == key:
        return session.replay[1], session.replay[2]
    if op == "prefill" and epoch > session.epoch:
        return None
    if op == "verify" and (epoch, committed) == (session.epoch, session.committed):
        return None
    raise StaleStepError(
        f"{op} for epoch {epoch} at committed length {committed}, but session {session.name!r} is at epoch "
        f"{session.epoch} with {session.committed} committed tokens: a stale or out-of-order request")
