"""Suffix decoding where its counts vouch for a continuation, another drafter (a draft head) elsewhere.

Which draft pays changes within a prompt, not only between prompts: a model draft wins on new text, suffix
decoding where the output repeats the prompt or an earlier response, and there it drafts longer and for
nearly nothing. Arctic Inference pairs suffix decoding with its own speculator this way. Each step asks
the suffix drafter first (it must see every step's context anyway, to index it) and keeps its proposal when
the expected accepted tokens it reports reach `hand_over`; otherwise the other drafter proposes, with at most
`other_k` of the step's budget (a head's tree pays at a few nodes, suffix decoding at many). The choice
is a function of the context alone and each proposal carries its own drafter's q, so every verification
rule stays exact.
"""
from __future__ import annotations

from typing import Optional, Sequence

from specbench.types import DraftTree, SpecbenchError


class HybridDrafter:
    def __init__(self, suffix, other, hand_over: float, other_k: Optional[int] = None, name: str = "suffix-eagle"):
        if hand_over < 0 or (other_k is not None and other_k < 1):
            raise SpecbenchError(f"a hybrid needs hand_over >= 0 and other_k >= 1, got {hand_over}, {other_k}")
        self.suffix, self.other, self.hand_over, self.other_k, self.name = suffix, other, hand_over, other_k, name
        self.last_source = ""  # which drafter the last step's proposal came from: "suffix" or "other"
        self.steps = {"suffix": 0, "other": 0}

    def bind(self, target, session: str) -> None:
        if hasattr(self.other, "bind"):
            self.other.bind(target, session)

    def propose(self, context: Sequence[int], k: int, sampling, draws, max_depth: Optional[int] = None) -> DraftTree:
        found = self.suffix.propose(context, k, sampling, draws, max_depth)
        if len(found) and (found.expected_accepted or 0.0) >= self.hand_over:
            self.last_source = "suffix"
        else:
            budget = k if self.other_k is None else min(k, self.other_k)
            found, self.last_source = self.other.propose(context, budget, sampling, draws, max_depth), "other"
        self.steps[self.last_source] += 1
        return found

    def finish(self, context: Sequence[int]) -> None:
        self.suffix.finish(context)
        if hasattr(self.other, "finish"):
            self.other.finish(context)

    def remember(self, output: Sequence[int]) -> None:
        self.suffix.remember(output)
