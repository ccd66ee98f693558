"""One speculative step: draft up to k nodes, verify them in one target forward.

`speculative_step` is the step; `ProactiveDrafting` is the same step that keeps drafting while
its verify is in flight. The loop takes either as its `step` and cannot tell them apart.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

from specbench.decode.drafters import Drafter
from specbench.decode.target import PendingVerdict, Target
from specbench.sampling.streams import Streams
from specbench.types import DraftTree, SamplingParams, Verdict


@dataclass
class Step:
    tree: DraftTree
    verdict: Verdict
    draft_s: float
    lookahead_drafted: int = 0  # proactive drafting: tokens drafted while the verify was in flight
    lookahead_discarded: int = 0  # ... of which the verdict made useless
    lookahead_reused: int = 0  # tokens of this step's chain that were drafted ahead last step


def speculative_step(target: Target, drafter: Optional[Drafter], session: str, context: list[int], k: int,
                     max_depth: int, sampling: SamplingParams, streams: Streams) -> Step:
    """Draft at most `k` nodes and `max_depth` levels past `context` (none for k = 0 or no drafter:
    a plain target step), then verify them with the verify seed of `streams`."""
    started = time.perf_counter()
    tree = DraftTree()
    if drafter is not None and k > 0 and max_depth > 0:
        tree = drafter.propose(context, k, sampling, streams.draft, max_depth=max_depth)
    draft_s = time.perf_counter() - started
    return Step(tree, target.verify(session, tree, sampling, streams.verify_seed()), draft_s)


class ProactiveDrafting:
    """A chain step that drafts past its chain while the verify is in flight (AutoDraft's proactive
    drafting), and opens the next chain with that look-ahead when the verdict confirms it: the whole
    chain accepted and the bonus token equal to the first token drafted ahead.

    Draft draws are keyed by position (sampling/streams.py), so a reused token is exactly the one a
    plain step would draw: the output never depends on how long a verify took, only the time does.
    Example: chain [5, 6] verified while [9, 4, 2] is drafted ahead; the verdict accepts 5 and 6 with
    bonus 9, so the next chain starts [4, 2] (2 reused); a bonus of 7 would discard all 3.
    Over a target that verifies in place (local) nothing is in flight, so nothing is drafted ahead.
    """

    def __init__(self):
        self.ahead: Optional[DraftTree] = None
        self.ahead_of: list[int] = []  # the context the look-ahead continues

    def __call__(self, target: Target, drafter: Optional[Drafter], session: str, context: list[int], k: int,
                 max_depth: int, sampling: SamplingParams, streams: Streams) -> Step:
        if drafter is None or k < 1 or max_depth < 1:
            self.ahead = None
            return speculative_step(target, drafter, session, context, k, max_depth, sampling, streams)
        started = time.perf_counter()
        limit = min(k, max_depth)
        reused = _prefix(self.ahead, limit) if self.ahead is not None and self.ahead_of == context else DraftTree()
        tree = reused
        if len(reused) < limit:
            tree = _joined(reused, drafter.propose(context + list(reused.tokens), limit - len(reused), sampling,
                                                   streams.draft))
        draft_s = time.perf_counter() - started
        pending = target.verify_begin(session, tree, sampling, streams.verify_seed())
        chain_end = context + list(tree.tokens)
        ahead = self._draft_ahead(drafter, chain_end, k + 1, sampling, streams, pending)
        verdict = pending.result()
        confirmed = len(verdict.accepted_path) == len(tree) and len(ahead) > 0 and ahead.tokens[0] == verdict.bonus_token
        self.ahead = _suffix(ahead) if confirmed else None
        self.ahead_of = chain_end + [verdict.bonus_token]
        return Step(tree, verdict, draft_s, lookahead_drafted=len(ahead),
                    lookahead_discarded=0 if confirmed else len(ahead), lookahead_reused=len(reused))

    @staticmethod
    def _draft_ahead(drafter, chain_end, limit, sampling, streams, pending: PendingVerdict) -> DraftTree:
        ahead = DraftTree()
        while len(ahead) < limit and not pending.ready():
            more = drafter.propose(chain_end + list(ahead.tokens), 1, sampling, streams.draft)
            if not len(more):  # a drafter with nothing to say (a cross-tokenizer draft at a text boundary)
                break
            ahead = _joined(ahead, more)
        return ahead


def _joined(first: DraftTree, second: DraftTree) -> DraftTree:
    """Two chains, one after the other."""
    if not len(first):
        return second
    dists = None if first.draft_dists is None or second.draft_dists is None else first.draft_dists + second.draft_dists
    joined = DraftTree.chain(first.tokens + second.tokens, dists)
    if second.cross_tokenizer:
        joined = replace(joined, cross_tokenizer=second.cross_tokenizer,
                         draft_tokens=(first.draft_tokens or 0) + (second.draft_tokens or 0))
    return joined


def _prefix(chain: DraftTree, length: int) -> DraftTree:
    return DraftTree.chain(chain.tokens[:length], chain.draft_dists[:length] if chain.draft_dists else None)


def _suffix(chain: DraftTree) -> DraftTree:
    return DraftTree.chain(chain.tokens[1:], chain.draft_dists[1:] if chain.draft_dists else None)
