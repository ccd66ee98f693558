"""Plain data shared by every layer: sampling settings, draft trees, verdicts, step records.

Nothing here imports torch, so the planning layer and the wire protocol can use these types
without pulling in a deep-learning stack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Optional, Sequence

VERIFY_RULES = ("greedy", "rejection", "sample-match")
FAST_BACKENDS = ("compile", "cudagraph", "compiled-graph", "static")  # `fast=` (decode/fast_forward.py); True: the device's
CROSS_TOKENIZER_RULES = ("auto", "text", "shared-vocab")  # how a draft with another tokenizer reaches target ids


class SpecbenchError(ValueError):
    """Base of every error specbench raises on bad input; the message names the problem."""


def reason(error: BaseException) -> str:
    """A library's exception in a few words for a message of ours: its kind and its first sentence (the
    readers of damaged files explain at length, and each raises its own kind for one cause)."""
    words = str(error).splitlines()[0].split(". ")[0][:160] if str(error) else ""
    return f"{type(error).__name__}: {words}" if words else type(error).__name__


# chain-confident's threshold unless one is given: Hugging Face's assisted generation default
STOP_BELOW = 0.4


def check_stop_below(stop_below: float) -> float:
    """chain-confident's threshold, a probability in [0, 1): a chain ends after a token its draft gave less."""
    if not 0.0 <= stop_below < 1.0:
        raise SpecbenchError(f"stop_below is a probability in [0, 1), got {stop_below!r}")
    return stop_below


def reply_length_note(measured: Optional[int], asked: int, subject: str, remedy: str) -> Optional[str]:
    """Why a choice made on replies of up to `measured` tokens (`subject`: "this router was calibrated") may not hold
    for replies of `asked`, when they are over twice or under half as long: what a method drafts changes along a
    reply (SmolLM2's MT-bench replies repeat themselves past 128 tokens, where prompt lookup drafted 2.6x its first
    32 tokens' rate); else None, and None where `measured` is unknown."""
    if not measured or measured / 2 <= asked <= measured * 2:
        return None
    return (f"{subject} on replies of up to {measured} tokens and now serves {asked}-token ones: what each method "
            f"drafts changes along a reply (copying methods gain in long ones), so its choice was checked only for "
            f"replies like those; {remedy}")


def machine_note(measured_on: Optional[str], here: str, subject: str, remedy: str) -> Optional[str]:
    """Why a choice measured on one machine (`hardware.machine_of`; `subject`: "the tune's choice was measured") may
    not hold on `here`: a draft's cost against the target's moves with the machine, and the best method and K with
    it. None on the same machine, or where `measured_on` is unknown (a file from before machines were kept); through
    a worker, this side is compared (the part before " -> "): the worker is its own."""
    if not measured_on or measured_on.split(" -> ")[0] == here.split(" -> ")[0]:
        return None
    return (f"{subject} on {measured_on}, and this machine is {here}: a draft's cost against the target's moves "
            f"with the machine, and the best method and K with it, so the choice was not checked here; {remedy}")


def default_rule(temperature: float) -> str:
    """The rule of a caller that names none: greedy at temperature 0, else rejection (exact, and it
    accepts the most of a draft model's drafts; sample-match is the one for drafts without q)."""
    return "greedy" if temperature == 0 else "rejection"


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution p is formed; temperature 0 means greedy.

    `rule` picks the verification rule; under greedy decoding every rule reduces to argmax matching.
    `draft_top_k` bounds the draft distribution q to an exactly sparse top-k so that q can travel
    as (ids, probabilities) and rejection sampling stays exact.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    rule: str = "greedy"
    draft_top_k: int = 32

    def __post_init__(self):
        for name, kind in (("temperature", Real), ("top_k", Integral), ("top_p", Real), ("draft_top_k", Integral)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an integer" if kind is Integral else "a number"
                raise SpecbenchError(f"{name} must be {what}, got {value!r}")
            if not math.isfinite(value):
                raise SpecbenchError(f"{name} must be finite, got {value!r}")
        if not isinstance(self.rule, str):
            raise SpecbenchError(f"rule must be a string, got {self.rule!r}")
        if self.temperature < 0:
            raise SpecbenchError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecbenchError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecbenchError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.rule not in VERIFY_RULES:
            raise SpecbenchError(f"unknown verification rule {self.rule!r}; choose one of {VERIFY_RULES}")
        if self.rule == "greedy" and self.temperature > 0:  # it would verify by argmax: greedy text, silently
            raise SpecbenchError(
                f"temperature {self.temperature} asks for sampling, but rule 'greedy' verifies by the target's "
                f"argmax (the text would be greedy's): pass rule='rejection' or 'sample-match'")
        if self.draft_top_k < 1:
            raise SpecbenchError(f"draft_top_k must be >= 1, got {self.draft_top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_rule(self) -> str:
        return "greedy" if self.greedy else self.rule


@dataclass(frozen=True)
class SparseDist:
    """An exactly sparse distribution: probability `probs[i]` on token `ids[i]`, zero elsewhere."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens and their parents; parent -1 is the last committed token (the root).

    A chain of K tokens is the tree whose parents are (-1, 0, 1, ..., K-2). Parents always precede
    their children, so a single forward over the nodes in order respects causality.
    `draft_dists[i]` is the draft distribution q that node i's token was drawn from (its parent's
    step); None when the drafter is deterministic but not describable (greedy-only drafters).
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    draft_dists: Optional[tuple[SparseDist, ...]] = None
    # The drafter's own forecast of accepted tokens (sum of path probabilities); stays client-side.
    expected_accepted: Optional[float] = field(default=None, compare=False)
    # A draft with another tokenizer: tokens it produced in its own vocabulary, and the rule that
    # carried them into target ids ("text" or "shared-vocab"); client-side, for the records.
    draft_tokens: Optional[int] = field(default=None, compare=False)
    cross_tokenizer: str = field(default="", compare=False)
    # A hybrid's step: which of its drafters proposed it ("suffix" or "other"); client-side, for the records
    # and the planner, which prices the two kinds of step apart.
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise SpecbenchError(
                f"draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise SpecbenchError(
                    f"draft tree node {i} has parent {parent}; a parent must be -1 (root) or an "
                    f"earlier node (0..{i - 1}), so cycles and parent-after-child are refused")
        if self.draft_dists is not None and len(self.draft_dists) != len(self.tokens):
            raise SpecbenchError(
                f"draft tree has {len(self.tokens)} tokens but {len(self.draft_dists)} draft distributions")

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_dists: Optional[Sequence[SparseDist]] = None) -> "DraftTree":
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)),
                   None if draft_dists is None else tuple(draft_dists))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node, 1 for children of the root."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def widths(self) -> list[int]:
        """Number of nodes at each depth 1..max depth."""
        depths = self.depths()
        return [depths.count(d) for d in range(1, max(depths, default=0) + 1)]

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 for the root) in node order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def followed(self, tokens: Sequence[int]) -> int:
        """How deep the path of this tree that `tokens` follow from the root goes: the tokens greedy verification
        accepts when the target continues with `tokens`."""
        depth, node = 0, -1
        while depth < len(tokens):
            node = next((child for child in self.children(node) if self.tokens[child] == tokens[depth]), None)
            if node is None:
                break
            depth += 1
        return depth


@dataclass(frozen=True)
class Timing:
    """Where a verify's time went, under the names the records and DataFrames use.

    `verify_s` is the target's whole verify (forward and verification rule); `queue_s` the time a
    shared worker held the request before its batch started; `network_s` is a remote round trip
    minus the worker's own time (queue included), of which `emulated_network_s` was added by
    NetworkEmulation (never hidden); bytes count whole messages each way.
    """

    target_forward_s: float = 0.0
    verify_s: float = 0.0
    queue_s: float = 0.0
    batch_size: int = 1  # verifies that shared the target's forward
    batch_round: int = -1  # the worker's number for that forward (-1: local)
    network_s: float = 0.0
    emulated_network_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass(frozen=True)
class Verdict:
    """What the target decided for one draft tree: the accepted node path from the root down and
    the recovered/bonus token the target produced itself; `timing` says what it cost."""

    accepted_path: tuple[int, ...]
    bonus_token: int
    timing: Timing = Timing()

    def emitted(self, tree: DraftTree) -> list[int]:
        return [tree.tokens[i] for i in self.accepted_path] + [self.bonus_token]


@dataclass
class StepRecord:
    """One speculative step, raw: every metric is derived from these by pure functions.
    Built in one place, `specbench.decode.records.record_step`; the README lists the columns."""

    prompt_index: int
    step: int
    method: str
    kind: str  # the method's kind from the method table: none, chain or tree
    planned: bool  # a step planner chose step_k
    step_k: int  # draft tokens (chain) or nodes (tree) this step asked for; 0 for a plain target step
    drafted: int
    accepted: int
    emitted: int
    emitted_tokens: list[int]
    bonus_token: int
    draft_s: float
    target_forward_s: float
    verify_s: float
    queue_s: float  # waiting in a shared worker's queue
    batch_size: int  # verifies that shared the target's forward (1 locally)
    batch_round: int  # the worker's number for that forward: rows with one number shared it (-1 locally)
    network_s: float
    emulated_network_s: float
    step_s: float
    overhead_s: float  # step_s not spent drafting, queued, verifying or on the network: the loop's own cost
    bytes_up: int = 0
    bytes_down: int = 0
    tree_depth: int = 0
    tree_widths: list[int] = field(default_factory=list)
    expected_accepted: Optional[float] = None  # drafter's forecast, for planner calibration
    lookahead_drafted: int = 0  # proactive drafting: tokens drafted while the verify was in flight
    lookahead_discarded: int = 0  # ... of which the verdict made useless
    lookahead_reused: int = 0  # tokens of this step's chain that were drafted ahead last step
    cross_tokenizer: str = ""  # "" when the draft speaks the target's vocabulary, else the rule: text | shared-vocab
    draft_tokens: Optional[int] = None  # tokens the draft model produced in its own vocabulary (cross-tokenizer)
    draft_source: str = ""  # a hybrid's step: "suffix" (suffix decoding drafted it) or "other" (its head or model)
