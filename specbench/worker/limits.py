"""The worker's limits: every request is checked against them before any work starts.

Why: the worker is shared; without a bound per request, one client's `profile` or 3,000-sibling
tree holds the model while every other client's requests time out.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from specbench.worker.protocol import LimitError


@dataclass(frozen=True)
class WorkerLimits:
    """Defaults suit a shared CPU or single-GPU worker; every one is a `specbench worker` flag."""

    max_sessions: int = 64  # open sessions in all
    max_sessions_per_client: int = 8  # per client (CURVE key, else client token) and per connection
    max_prompt_tokens: int = 4096  # tokens in one prefill (and a server-only prompt)
    max_tree_nodes: int = 256  # draft nodes in one verify
    max_generate_k: int = 8  # draft forwards per step of a server-only generate (a step is one slice)
    max_new_tokens: int = 1024  # tokens one server-only `generate` may produce
    max_profile_points: int = 64  # (tokens, context) points in one `profile`
    max_profile_repeats: int = 20  # timed repeats per profile point
    max_kv_bytes: Optional[int] = None  # KV cache of all sessions; None: half the memory free at start
    max_request_bytes: int = 1 << 20  # one inbound message
    inbound_queue: int = 16  # messages buffered per connection while busy (ZMQ RCVHWM; then TCP backpressure)

    def __post_init__(self):
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None and value < 1:
                raise LimitError(f"worker limit {item.name} must be >= 1, got {value}")


def check(value: int, limit: int, what: str, flag: str) -> None:
    """Refuse `value` over `limit`, naming the limit and the flag that raises it."""
    if value > limit:
        raise LimitError(f"{what}: {value} exceeds the worker's limit of {limit} ({flag})")


LIMIT_FLAGS = {
    "max_sessions": ("--max-sessions", "open sessions in all"),
    "max_sessions_per_client": ("--max-sessions-per-client", "open sessions per client and per connection"),
    "max_prompt_tokens": ("--max-prompt-tokens", "tokens in one prefill or server-only prompt"),
    "max_tree_nodes": ("--max-tree-nodes", "draft nodes in one verify"),
    "max_generate_k": ("--max-generate-k", "draft forwards per step of a server-only generate (one slice)"),
    "max_new_tokens": ("--max-new-tokens", "tokens one server-only generate may produce"),
    "max_profile_points": ("--max-profile-points", "(tokens, context) points in one profile"),
    "max_profile_repeats": ("--max-profile-repeats", "timed repeats per profile point"),
    "max_kv_bytes": ("--max-kv-gib", "KV cache of all sessions, the incoming request included"),
    "max_request_bytes": ("--max-request-bytes", "bytes in one inbound message"),
    "inbound_queue": ("--inbound-queue", "messages buffered per connection while busy"),
}
