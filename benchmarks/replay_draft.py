"""`TraceDrafter`, for the GPU worker benchmarks: acceptance that follows a recorded trace (targets with random
weights). A real draft's recorded proposals are replayed by `specbench.decode.replay_drafter`."""
from __future__ import annotations

import time
from typing import Sequence

from specbench.types import DraftTree


class TraceDrafter:
    """A draft whose acceptance follows a recorded trace, for targets with random weights (GPU benchmarks
    that carry no checkpoint): given the target's greedy continuation of the prompt, each step proposes
    the next `a` tokens of it (a: the trace's next accepted length) and then a token the target will not
    choose, after sleeping `draft_s` (a draft's time on the user's device). A context off that
    continuation (a batched near-tie took another greedy token) is a miss: its chain is all wrong tokens.
    Verification is the target's as always, so the output stays the target's own greedy one."""

    name = "trace-draft"

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int], accepts: Sequence[int], draft_s: float,
                 vocab: int):
        self.prompt, self.continuation, self.accepts = list(prompt), list(continuation), list(accepts)
        self.draft_s, self.vocab, self.steps, self.misses = draft_s, vocab, 0, 0

    def propose(self, context, k, sampling, draws, max_depth=None) -> DraftTree:
        time.sleep(self.draft_s)
        done = list(context[len(self.prompt):])
        on_track = list(context[:len(self.prompt)]) == self.prompt and done == self.continuation[:len(done)]
        accepted = min(self.accepts[self.steps % len(self.accepts)], k) if on_track else 0
        self.steps += 1
        self.misses += not on_track
        ahead = self.continuation[len(done):len(done) + accepted] if on_track else []
        chosen = self.continuation[len(done) + len(ahead)] if on_track and len(done) + len(ahead) < len(
            self.continuation) else context[-1]
        wrong = (chosen + 1) % self.vocab  # never the target's choice at the first unaccepted position
        return DraftTree.chain(list(ahead) + [wrong] * (k - len(ahead)))
