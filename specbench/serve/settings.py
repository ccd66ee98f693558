"""What `specbench serve` was started with and what one request may ask of it (torch-free, validated).

Why a module of its own: the HTTP layer, the engine and the CLI must agree on one list of what a
server offers (methods, K, limits); a request asking for anything else is refused by name here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from specbench.types import STOP_BELOW, SpecbenchError, check_stop_below


AUTO = "auto"  # the method a router resolves per request (not in the method table: it drafts as its choice does)


class RequestError(SpecbenchError):
    """A request the server refuses: `status` is the HTTP code, `param` the field named to the client."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request, and all of them together, may take."""

    max_tokens: int = 512  # a request's max_tokens
    max_prompt_tokens: int = 2048
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 4  # generations at once (each holds one worker session)
    max_queue: int = 16  # requests waiting for a slot; beyond them: 429 with Retry-After
    max_stop: int = 4  # stop strings per request
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_tokens", "max_prompt_tokens", "max_body_bytes", "max_concurrent", "retry_after_s"):
            if getattr(self, name) < 1:
                raise SpecbenchError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise SpecbenchError(f"max_queue must be >= 0, got {self.max_queue}")


@dataclass(frozen=True)
class ServeSettings:
    """The server's target, the speculative settings it offers, and where it listens.

    `methods` are the methods a request may pick (the first is the default); each drafts from
    `draft` when it needs a model. `k` is the default K (chain tokens or tree nodes); a request may
    ask for 1..`max_k`. `plan`: a step planner from the cached profiles picks K per step.
    """

    target: str
    methods: tuple[str, ...] = ("target-only",)
    draft: Optional[str] = None
    k: int = 4
    max_k: int = 8
    plan: bool = False
    self_draft_layers: Optional[int] = None
    substitute_quantization: str = "8bit"
    worker: Optional[str] = None  # a worker endpoint; None: one started in this process
    dtype: str = "float32"
    device: str = "cpu"  # where the worker started in this process runs the target, and a --draft runs
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = field(default=None, repr=False)
    limits: Limits = Limits()
    suffix: Any = None  # SuffixSettings of the suffix methods (`--suffix`): default knobs, the cache's scope
    router: Optional[str] = None  # a router file (`specbench route`): method `auto` picks each request's method and K
    stop_below: float = STOP_BELOW  # chain-confident and its hybrid: a chain ends at a token its draft gave less
    tuned: Optional[tuple[str, int]] = None  # a --config's method and the reply length (tokens) it was measured at

    def __post_init__(self):
        from specbench.methods import get_method

        if not self.methods:
            raise SpecbenchError("offer at least one method")
        if AUTO in self.methods and self.router is None:
            raise SpecbenchError("method 'auto' routes each request to the method and K a router predicts fastest "
                                 "for its prompt: start serve with --router FILE (from `specbench route`)")
        for name in self.methods:
            if name == AUTO:
                continue
            method = get_method(name)
            if method.on_worker:
                raise SpecbenchError(f"method {name!r} runs wholly on a worker; serve drafts here: offer another")
        if not 1 <= self.k <= self.max_k:
            raise SpecbenchError(f"k must be in 1..max_k ({self.max_k}), got {self.k}")
        check_stop_below(self.stop_below)
        if not 0 <= self.port <= 65535:
            raise SpecbenchError(f"port must be in 0..65535, got {self.port}")

    @property
    def default_method(self) -> str:
        return self.methods[0]

    @property
    def machine(self) -> str:
        """What this server's choices run on (`hardware.machine_label`): this machine, and the device the target
        runs on here (with --worker, the worker's is its own)."""
        from specbench.hardware import machine_label

        return machine_label("cpu" if self.worker else self.device)

    def tune_note(self, method: str, max_tokens: int) -> Optional[str]:
        """Why a request running the tune's method may not run as the tune measured it: replies over twice or
        under half the tune's length (`tune.report.length_note`); None otherwise, or with no --config."""
        from specbench.tune.report import length_note

        if self.tuned is None or method != self.tuned[0]:
            return None
        return length_note(self.tuned[1], max_tokens)


@dataclass(frozen=True)
class Speculation:
    """What one request decodes with: a method the server offers, its K, and for suffix methods the
    step knobs it changes (`suffix`: sorted (field, value) pairs over the server's settings)."""

    method: str
    k: int
    suffix: tuple = ()

    @classmethod
    def from_request(cls, asked, settings: ServeSettings) -> "Speculation":
        """`extra_body={"speculative": {"method": ..., "k": ...}}`, checked against what the server offers."""
        if asked is None:
            return cls(settings.default_method, settings.k)
        if not isinstance(asked, dict):
            raise RequestError("speculative must be an object like {\"method\": \"chain\", \"k\": 4}", "speculative")
        unknown = set(asked) - {"method", "k", "suffix"}
        if unknown:
            raise RequestError(f"speculative takes method, k and suffix, not {sorted(unknown)}", "speculative")
        method = asked.get("method", settings.default_method)
        if method not in settings.methods:
            raise RequestError(f"method {method!r} is not offered by this server (started with "
                               f"{', '.join(settings.methods)}); restart it with --method {method}",
                               "speculative.method")
        if method == AUTO and "k" in asked:
            raise RequestError("method 'auto' takes no k: the server's router picks each request's method and K",
                               "speculative.k")
        k = asked.get("k", settings.k)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= settings.max_k:
            raise RequestError(f"speculative.k must be an integer in 1..{settings.max_k}, got {k!r}", "speculative.k")
        return cls(method, k, _suffix_knobs(asked.get("suffix"), method))


def _suffix_knobs(asked, method: str) -> tuple:
    """A request's suffix step knobs, checked as a worker checks a client's (`protocol.suffix_from_wire`)."""
    if asked is None:
        return ()
    if not method.startswith("suffix"):
        raise RequestError(f"speculative.suffix sets suffix decoding's knobs; method {method!r} does not use them",
                           "speculative.suffix")
    from specbench.worker.protocol import ProtocolError, suffix_from_wire

    try:
        return tuple(sorted(suffix_from_wire(asked, caches=False).items()))
    except ProtocolError as error:
        raise RequestError(str(error), "speculative.suffix") from None
