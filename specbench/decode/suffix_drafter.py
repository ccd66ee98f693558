"""Suffix decoding: draft from the request's own prompt and output, and from earlier requests' outputs.

Each request's context (prompt, then its output as it grows) is indexed for its own drafts; its output
also goes into a `SuffixCache` of earlier outputs, bounded in requests and tokens (the oldest output is
evicted first), so a later request that repeats what an earlier one said (agentic loops, resent files,
multi-turn chats) drafts it. Each step proposes from whichever of the two scores higher: the expected
number of accepted tokens, from how often each continuation was seen. Proposals are deterministic given
the context and the cache, so each node's q is a point mass: exact under every verification rule.

Where the cache is shared is configured (`SuffixSettings.cache`): "process" (every suffix drafter of this
process over the same target, e.g. one notebook's runs, or one worker tenant's requests), "drafter" (this
drafter's requests only: one `run` call) or "off" (each request drafts from itself only).
"""
from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from specbench.decode.suffix_index import SuffixDraft, SuffixIndex
from specbench.types import DraftTree, SparseDist, SpecbenchError

CACHE_SCOPES = ("process", "drafter", "off")
UNLIMITED = ("catch_up", "trust")  # the knobs whose `inf` means no limit
HEAD_BENCH_BELOW = 0.3  # `SuffixSettings.bench_below` behind a head when unset


@dataclass(frozen=True)
class SuffixSettings:
    """Suffix decoding's knobs. A step proposes at most min(k, factor * matched tokens + offset) tokens (a long
    match earns a long draft), none with an estimated probability under `min_prob`; `depth` bounds both the
    match and the draft. A step whose proposal expects fewer than `min_score` accepted tokens drafts nothing:
    where a verify of two tokens costs much more than one (1.7x for SmolLM2 in float32 on an AVX2 CPU, about
    1.1x in bf16 with AVX-512), a doubtful draft loses more than it brings; `route.suffix_floor` picks it
    from a calibration run. The cache keeps at most `cache_requests` outputs and `cache_tokens`
    tokens (its index holds up to `depth` nodes a token: about 1.5 KB a token at depth 24 on random text, less
    on text that repeats). In a hybrid (`suffix-eagle`, `suffix-chain`), a step whose suffix proposal expects
    fewer accepted tokens than `hand_over` is drafted by the other drafter (the head, the draft model) instead,
    with at most `other_k` tokens (chain) or nodes (tree): its budget pays at a few nodes, suffix decoding's at
    many; and only while the context a draft model has not read yet (the whole prompt on its first step) is at
    most `catch_up` times the tokens the request may still emit: reading a prompt costs the draft a prefill,
    which a short answer never wins back (the 0.5B Qwen read a 750-token prompt in 4 s on a 2-core CPU, about
    ten of the 1.5B target's steps, for a 40-token answer). A hybrid also scales each score by suffix decoding's
    record in the request, (accepted + `trust`) / (expected + `trust`) over the steps it drafted there: its
    counts over-promise on new text (1.4 tokens expected, 0.13 accepted on translation prompts, the Qwen pair),
    and a request shows it within a few steps; inf takes the scores as they are. With `bench_below` > 0 the other
    drafter drafts no more in a request where its steps have gained fewer accepted tokens a step than that (one
    step of 1 token to start): its forward and a wider verify buy nothing on text it cannot draft. Unset, it is
    `HEAD_BENCH_BELOW` behind a head, whose fixed tree widens every verify however little it gains, and 0 behind
    a draft model, whose confident chain already stops where it is unsure (`bench_for`)."""

    depth: int = 24
    factor: float = 1.0
    offset: float = 0.0
    min_prob: float = 0.1
    min_score: float = 0.0
    cache: str = "process"
    cache_requests: int = 1000
    cache_tokens: int = 100_000
    name: str = ""  # "process" scope: drafters naming one cache share it, others keep theirs apart
    hand_over: float = 1.0
    other_k: int = 4
    catch_up: float = math.inf  # inf: the draft model drafts whatever it must read first
    trust: float = 2.0  # expected tokens of record at 1:1 a request starts a hybrid with (inf: scores as they are)
    bench_below: Optional[float] = None  # hybrids: the other drafter's accepted tokens a step below which a request
    # benches it; None: the drafter's own default (`bench_for`)

    def __post_init__(self):
        if self.cache not in CACHE_SCOPES:
            raise SpecbenchError(f"suffix cache must be one of {CACHE_SCOPES}, got {self.cache!r}")
        if self.cache_requests < 1 or self.cache_tokens < 1:
            raise SpecbenchError(f"the suffix cache needs room: cache_requests {self.cache_requests} and "
                                 f"cache_tokens {self.cache_tokens} must be >= 1 (cache='off' turns it off)")
        if not 0.0 <= self.min_prob <= 1.0:
            raise SpecbenchError(f"min_prob must be in [0, 1], got {self.min_prob}")
        if self.min_score < 0:
            raise SpecbenchError(f"min_score must be >= 0 (expected accepted tokens), got {self.min_score}")
        if self.hand_over < 0 or self.other_k < 1:
            raise SpecbenchError(f"need hand_over >= 0 and other_k >= 1, got {self.hand_over}, {self.other_k}")
        if not self.trust > 0:
            raise SpecbenchError(f"trust must be > 0 (inf: scores as they are), got {self.trust}")
        if self.bench_below is not None and not 0 <= self.bench_below < math.inf:
            raise SpecbenchError(f"bench_below must be a finite number >= 0 (0: never bench), got {self.bench_below}")
        if not self.catch_up >= 0:
            raise SpecbenchError(f"catch_up must be >= 0 (inf: no limit), got {self.catch_up}")
        if self.factor <= 0 or self.offset < 0:
            raise SpecbenchError(f"need factor > 0 and offset >= 0, got {self.factor}, {self.offset}")

    def bench_for(self, head: bool) -> float:
        """The bench a hybrid runs: as set, else `HEAD_BENCH_BELOW` behind a head and 0 behind a draft model (on
        SmolLM2 in bf16 a head hybrid ran 1.034-1.038x itself unbenched at 0.3, while the Qwen pair's SmolLM2 draft
        ran 0.983x: benchmarks/results/2026-12-05-workload-heads-by-family.md)."""
        if self.bench_below is not None:
            return self.bench_below
        return HEAD_BENCH_BELOW if head else 0.0


def as_settings(value) -> SuffixSettings:
    """`run(suffix=...)`'s value as settings: None the defaults, a dict their fields by name (an unknown one refused
    by name, not as a TypeError about keyword arguments)."""
    from dataclasses import fields

    if value is None or isinstance(value, dict):
        names = [field.name for field in fields(SuffixSettings)]
        unknown = sorted(set(value or {}) - set(names))
        if unknown:
            raise SpecbenchError(f"SuffixSettings has no field(s) {unknown}; its fields: {names}")
        return SuffixSettings(**(value or {}))
    if not isinstance(value, SuffixSettings):
        raise SpecbenchError(f"suffix= takes a SuffixSettings or a dict of its fields, got {type(value).__name__}")
    return value


def suffix_options(words: Sequence[str]) -> dict:
    """SuffixSettings fields from `KEY=VALUE` words (`--suffix min_score=2 factor=2`), each typed as its
    field and refused by name: the command line's way to the knobs `run(suffix=...)` takes."""
    from dataclasses import fields

    types = {"int": int, "float": float, "str": str, "Optional[float]": float}
    kinds = {field.name: types[str(field.type)] for field in fields(SuffixSettings)}
    changes = {}
    for word in words:
        name, equals, text = word.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or name not in kinds:
            raise SpecbenchError(f"--suffix takes KEY=VALUE with KEY one of {list(kinds)}, got {word!r}")
        kind = kinds[name]
        try:
            value = kind(text)
        except ValueError:
            value = None
        unlimited = name in UNLIMITED and value == math.inf
        if value is None or (kind is float and not math.isfinite(value) and not unlimited):
            wanted = {int: "a whole number", float: "a finite number"}.get(kind, "text")
            wanted += " or inf" if name in UNLIMITED else ""
            raise SpecbenchError(f"--suffix {name} must be {wanted}, got {text!r}")
        changes[name] = value
    SuffixSettings(**changes)  # its own range checks, by name
    return changes


class SuffixCache:
    """Earlier requests' outputs, indexed together, evicting the oldest past `max_requests` outputs or
    `max_tokens` tokens. Safe to share between threads (a worker's requests)."""

    def __init__(self, depth: int = 24, max_requests: int = 1000, max_tokens: int = 100_000):
        self.index = SuffixIndex(depth)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._tokens = 0
        self._next = 0
        self.evicted = 0
        self._prompts: dict[int, int] = {}  # output id -> its prompt's fingerprint, where known
        self._held: Counter = Counter()  # fingerprint -> outputs of that prompt held
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._order)

    @property
    def tokens(self) -> int:
        return self._tokens

    def open(self, prompt: Sequence[int] = ()) -> int:
        """A new output's id (evicting the oldest when the cache holds `max_requests`); `prompt`, the request's
        own, is kept as a fingerprint so `holds` can tell a repeat of it."""
        with self.lock:
            while len(self._order) >= self.max_requests:
                self._evict()
            self._next += 1
            self._order[self._next] = None
            self.index.extend(self._next, ())
            if prompt:
                self._prompts[self._next] = print_of(prompt)
                self._held[self._prompts[self._next]] += 1
            return self._next

    def holds(self, prompt: Sequence[int]) -> bool:
        """Whether an output of this very prompt is in the cache. Why: suffix decoding then drafts the request
        from its own earlier answer (greedy: token for token), so a second run over the same prompts in one
        process measures that, not a first request (SmolLM2, HumanEval: 3.83x target-only instead of 1.47x)."""
        with self.lock:
            return self._held[print_of(prompt)] > 0

    def extend(self, output: int, tokens: Sequence[int]) -> None:
        """Append to an output (dropped silently once evicted: a long-running request outlived it)."""
        with self.lock:
            if output not in self._order or not tokens:
                return
            tokens = list(tokens)
            self.index.extend(output, tokens)
            self._tokens += len(tokens)
            while self._tokens > self.max_tokens:
                self._evict()

    def speculate(self, context: Sequence[int], budget: int, **options) -> SuffixDraft:
        with self.lock:
            return self.index.speculate(context, budget, **options)

    def match(self, context: Sequence[int], length: int):
        """The index's node of the context's last `length` tokens (None: never seen); a router's `seen_share`."""
        with self.lock:
            return self.index.match(context, length)

    def clear(self) -> None:
        with self.lock:
            while self._order:
                self._evict()

    def _evict(self) -> None:
        oldest, _ = self._order.popitem(last=False)
        if oldest in self._prompts:  # a prompt no output holds leaves the count (a server sees ever new ones)
            fingerprint = self._prompts.pop(oldest)
            self._held[fingerprint] -= 1
            if not self._held[fingerprint]:
                del self._held[fingerprint]
        self._tokens -= self.index.tokens(oldest)
        self.index.remove(oldest)
        self.evicted += 1


_PROCESS_CACHES: OrderedDict[tuple, SuffixCache] = OrderedDict()  # least recently used first
_PROCESS_LOCK = threading.Lock()
MAX_PROCESS_CACHES = 16  # a worker with many tenants keeps the caches of its 16 most recent only


def process_cache(key: tuple, settings: SuffixSettings) -> SuffixCache:
    """The process's cache for `key` (a target's identity, and a tenant's on a worker), made on first use;
    past `MAX_PROCESS_CACHES` the least recently used cache is dropped whole."""
    with _PROCESS_LOCK:
        full_key = (key, settings.name, settings.depth, settings.cache_requests, settings.cache_tokens)
        if full_key not in _PROCESS_CACHES:
            _PROCESS_CACHES[full_key] = new_cache(settings)
            while len(_PROCESS_CACHES) > MAX_PROCESS_CACHES:
                _PROCESS_CACHES.popitem(last=False)
        _PROCESS_CACHES.move_to_end(full_key)
        return _PROCESS_CACHES[full_key]


def process_cache_totals() -> dict:
    """How many suffix caches this process keeps and the tokens in them: what a worker's `stats` reports, so its
    operator sees the memory they hold (about 1.5 KB a token at depth 24)."""
    with _PROCESS_LOCK:
        caches = list(_PROCESS_CACHES.values())
    return {"suffix_caches": len(caches), "suffix_cache_tokens": sum(cache.tokens for cache in caches)}


def drop_process_caches(key: tuple) -> int:
    """Drop the process's caches whose key ends with `key` (a worker tenant's named cache it no longer keeps);
    how many went."""
    with _PROCESS_LOCK:
        gone = [full for full in _PROCESS_CACHES if full[0][len(full[0]) - len(key):] == key]
        for full in gone:
            del _PROCESS_CACHES[full]
        return len(gone)


def print_of(prompt: Sequence[int]) -> int:
    """A prompt's fingerprint in a cache (in-process only: Python's hash of a tuple of ints)."""
    return hash(tuple(int(token) for token in prompt))


def new_cache(settings: SuffixSettings) -> SuffixCache:
    return SuffixCache(settings.depth, settings.cache_requests, settings.cache_tokens)


class _Request:
    __slots__ = ("seen", "index", "output", "record")

    def __init__(self, prompt: list[int], depth: int, output: Optional[int]):
        self.seen = list(prompt)
        self.index = SuffixIndex(depth)
        self.index.extend(0, prompt)
        self.output = output  # its id in the shared cache, None without one
        self.record = None  # a hybrid's note of how suffix decoding's drafts fared in this request


class SuffixDrafter:
    """Suffix decoding (see module doc). `k` caps a step's draft; the counts choose how much of it to
    use, so steps draft anywhere from nothing to k tokens. `tree`: a tree of the most probable
    continuations instead of one chain. Requests are told apart by their contexts (a context that
    extends one seen before continues that request), so several may interleave; `finish` (called by
    the loop when a generation ends) takes in the last tokens and frees the request's own index."""

    def __init__(self, settings: SuffixSettings = SuffixSettings(), cache: Optional[SuffixCache] = None,
                 tree: bool = False, name: str = "suffix", max_active: int = 64):
        self.settings, self.tree, self.name = settings, tree, name
        if cache is None and settings.cache == "drafter":
            cache = new_cache(settings)
        self.cache = None if settings.cache == "off" else cache
        self.max_active = max_active
        self._active: OrderedDict[int, _Request] = OrderedDict()  # least recently drafted for first
        self._ids = 0
        self.last_source = ""  # where the last step's proposal came from: "request" or "cache"
        self.last_request: Optional[_Request] = None  # the request the last proposal was for

    def propose(self, context: Sequence[int], k: int, sampling, draws, max_depth: Optional[int] = None) -> DraftTree:
        if k < 1:
            raise SpecbenchError(f"draft budget must be >= 1, got {k}")
        context = list(context)
        request = self.last_request = self._request(context)
        chain_cap = k if max_depth is None else min(k, max_depth)
        budget = k if self.tree else chain_cap  # a tree keeps its node budget and is cut to max_depth below
        options = dict(tree=self.tree, min_prob=self.settings.min_prob, factor=self.settings.factor,
                       offset=self.settings.offset)
        found, self.last_source = request.index.speculate(context, budget, **options), "request"
        if self.cache is not None:
            shared = self.cache.speculate(context, budget, **options)
            if shared.score > found.score:
                found, self.last_source = shared, "cache"
        if max_depth is not None and self.tree:
            found = _within_depth(found, max_depth)
        if found.score < self.settings.min_score:  # not worth a wider verify: this step is the target's alone
            return DraftTree(expected_accepted=found.score)
        return DraftTree(found.tokens, found.parents, tuple(SparseDist((t,), (1.0,)) for t in found.tokens),
                         expected_accepted=found.score)

    def finish(self, context: Sequence[int]) -> None:
        """A generation ended with `context`: its last tokens go into the cache, its own index is freed."""
        context = list(context)
        key = self._find(context)
        if key is not None:
            self._take(self._active.pop(key), context)

    def remember(self, output: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Take in a request another method decoded (a router sent it elsewhere): its output (of `prompt`) still
        goes into the cache, as a server's cache sees every response."""
        if self.cache is not None and output:
            self.cache.extend(self.cache.open(prompt), list(output))

    def _request(self, context: list[int]) -> _Request:
        """The active request `context` continues (its new tokens taken in), or a new one."""
        key = self._find(context)
        if key is not None:
            self._active.move_to_end(key)
            self._take(self._active[key], context)
            return self._active[key]
        while len(self._active) >= self.max_active:
            self._active.popitem(last=False)
        self._ids += 1
        request = self._active[self._ids] = _Request(
            context, self.settings.depth, self.cache.open(context) if self.cache is not None else None)
        return request

    def _find(self, context: list[int]) -> Optional[int]:
        """The active request `context` extends, most recently drafted for first; None if none."""
        return next((key for key in reversed(self._active) if _extends(context, self._active[key].seen)), None)

    def _take(self, request: _Request, context: list[int]) -> None:
        new = context[len(request.seen):]
        if not new:
            return
        request.index.extend(0, new)
        if request.output is not None:
            self.cache.extend(request.output, new)
        request.seen += new


def _extends(context: list[int], seen: list[int]) -> bool:
    return len(context) >= len(seen) and context[:len(seen)] == seen


def _within_depth(found: SuffixDraft, max_depth: int) -> SuffixDraft:
    """The tree's nodes no deeper than `max_depth` (parents come first, so indices only shift down)."""
    depths = []
    for parent in found.parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    keep = [i for i, depth in enumerate(depths) if depth <= max_depth]
    if len(keep) == len(found.tokens):
        return found
    where = {old: new for new, old in enumerate(keep)}
    parents = tuple(-1 if found.parents[i] < 0 else where[found.parents[i]] for i in keep)
    probs = tuple(found.probs[i] for i in keep)
    return SuffixDraft(tuple(found.tokens[i] for i in keep), parents, probs, found.match_length, sum(probs))
