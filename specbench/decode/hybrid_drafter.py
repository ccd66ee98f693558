"""Suffix decoding where its counts vouch for a continuation, another drafter (a draft head) elsewhere.

Which draft pays changes within a prompt, not only between prompts: a model draft wins on new text, suffix
decoding where the output repeats the prompt or an earlier response, and there it drafts longer and for
nearly nothing. Arctic Inference pairs suffix decoding with its own speculator this way. Each step asks
the suffix drafter first (it must see every step's context anyway, to index it) and keeps its proposal when
the expected accepted tokens it reports reach `hand_over`; otherwise the other drafter proposes, with at most
`other_k` of the step's budget (a head's tree pays at a few nodes, suffix decoding at many). A draft model
must first read whatever of the context it has not (the whole prompt on its first step of a request); where
that is more than `catch_up` times the tokens the request may still emit, suffix decoding keeps the step:
the draft's prefill of a long prompt costs more than a short answer can win back (a summarization prompt of
750 tokens: 4 s of the 0.5B Qwen's time on 2 CPU cores, ten of its 1.5B target's steps, for 40 new tokens).
Suffix decoding's counts over-promise on new text (translation prompts of the Qwen pair: 1.4 tokens expected
a step, 0.13 accepted), so each request keeps its record, expected and accepted tokens over the steps suffix
decoding drafted there, and a score is scaled by (accepted + `trust`) / (expected + `trust`) before it meets
`hand_over`: a few steps of new text hand the request to the other drafter, while copied text keeps its
record near 1:1 and its steps. The other drafter keeps a record too: where its steps in a request have gained
fewer than `bench_below` accepted tokens a step (one step of 1 token to start), it drafts no more there and suffix
decoding's proposal, often nothing, takes the step: a head's or model's step costs its forward and a wider verify,
and on text it cannot draft (a head trained on English, asked to translate) that buys no token.
The choice is a function of the context (the record is read off how the context grew past each proposal), the
request's limit and earlier steps alone, never of the step's own draws, and each proposal carries its own
drafter's q, so every verification rule stays exact.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from specbench.types import DraftTree, SpecbenchError


class HybridDrafter:
    def __init__(self, suffix, other, hand_over: float, other_k: Optional[int] = None, name: str = "suffix-eagle",
                 catch_up: float = math.inf, trust: float = math.inf, bench_below: float = 0.0):
        if hand_over < 0 or (other_k is not None and other_k < 1) or not catch_up >= 0 or not trust > 0 \
                or not 0 <= bench_below < math.inf:
            raise SpecbenchError(f"a hybrid needs hand_over >= 0, other_k >= 1, catch_up >= 0, trust > 0 and a finite "
                                 f"bench_below >= 0, got {hand_over}, {other_k}, {catch_up}, {trust}, {bench_below}")
        self.suffix, self.other, self.hand_over, self.other_k, self.name = suffix, other, hand_over, other_k, name
        self.catch_up, self.trust, self.bench_below = catch_up, trust, bench_below
        self.benched = 0  # steps suffix decoding kept because the other drafter's record there fell below bench_below
        self.last_source = ""  # which drafter the last step's proposal came from: "suffix" or "other"
        self.steps = {"suffix": 0, "other": 0}
        self.kept_for_catch_up = 0  # steps suffix decoding kept because the other drafter had too much to read
        self._still_to_emit: Optional[int] = None  # the request's tokens still allowed, as its last step said

    def bind(self, target, session: str) -> None:
        if hasattr(self.other, "bind"):
            self.other.bind(target, session)

    def propose(self, context: Sequence[int], k: int, sampling, draws, max_depth: Optional[int] = None) -> DraftTree:
        if max_depth is not None:  # the loop's cap: the tokens still to emit, less one
            self._still_to_emit = max_depth + 1
        found = self.suffix.propose(context, k, sampling, draws, max_depth)
        record = self._record(context)
        expected = found.expected_accepted or 0.0
        if len(found) and expected * self._scale(record) >= self.hand_over:
            self.last_source = "suffix"
        elif self._too_much_to_read(context):
            self.last_source = "suffix"
            self.kept_for_catch_up += 1
        elif record is not None and bench(record.other_steps, record.other_accepted, self.bench_below):
            self.last_source = "suffix"
            self.benched += 1
        else:
            budget = k if self.other_k is None else min(k, self.other_k)
            found, self.last_source = self.other.propose(context, budget, sampling, draws, max_depth), "other"
        self.steps[self.last_source] += 1
        found = replace(found, source=self.last_source)
        if record is not None:
            record.pending = (len(context), found, expected, self.last_source) if len(found) else None
        return found

    def _record(self, context: Sequence[int]) -> Optional["_Record"]:
        """The request's record (None when the scores are taken as they are and nothing is benched), brought up to
        date: the last proposal's accepted tokens, suffix decoding's or the other drafter's, are those of its deepest
        path the context now continues with."""
        request = getattr(self.suffix, "last_request", None)
        if (math.isinf(self.trust) and not self.bench_below) or request is None:
            return None
        if request.record is None:
            request.record = _Record()
        record = request.record
        if record.pending is not None and len(context) > record.pending[0]:
            start, tree, expected, source = record.pending
            if source == "suffix":
                record.expected += expected
                record.accepted += tree.followed(context[start:])
            else:
                record.other_steps += 1
                record.other_accepted += tree.followed(context[start:])
        record.pending = None
        return record

    def _scale(self, record: Optional["_Record"]) -> float:
        return 1.0 if record is None else record_scale(record.expected, record.accepted, self.trust)

    def _too_much_to_read(self, context: Sequence[int]) -> bool:
        """Whether the other drafter would first read more than `catch_up` x the tokens still to emit (a
        look-ahead step, which is given no cap, takes its step's)."""
        pending = getattr(self.other, "pending", None)
        if math.isinf(self.catch_up) or pending is None or self._still_to_emit is None:
            return False
        return pending(context) > self.catch_up * self._still_to_emit

    def finish(self, context: Sequence[int]) -> None:
        self._still_to_emit = None
        self.suffix.finish(context)
        if hasattr(self.other, "finish"):
            self.other.finish(context)

    def remember(self, output: Sequence[int], prompt: Sequence[int] = ()) -> None:
        self.suffix.remember(output, prompt)

    @property
    def cache(self):
        """Its suffix half's cache of earlier outputs (None without one): what a router checks before feeding
        it an output twice."""
        return getattr(self.suffix, "cache", None)


class _Record:
    """Suffix decoding's expected and accepted tokens over the steps it drafted in one request, the other
    drafter's steps and accepted tokens there, and the last proposal still waiting for the next context: (the
    context's length then, the tree, its expected tokens, which drafter)."""

    __slots__ = ("expected", "accepted", "other_steps", "other_accepted", "pending")

    def __init__(self):
        self.expected, self.accepted, self.other_steps, self.other_accepted, self.pending = 0.0, 0, 0, 0, None


def record_scale(expected: float, accepted: float, trust: float) -> float:
    """What a suffix score is multiplied by, given suffix decoding's record in the request so far (1 at `trust`
    inf): the hybrid's rule, and its replay's (`route.hand_over`)."""
    return 1.0 if math.isinf(trust) else (accepted + trust) / (expected + trust)


def bench(steps: int, accepted: int, floor: float) -> bool:
    """Whether the other drafter drafts no more in a request where its `steps` gained `accepted` tokens (one
    step of 1 token to start, so a first failure does not bench it): the hybrid's rule, and its replay's."""
    return floor > 0 and (accepted + 1) / (steps + 1) < floor
