"""Clients on other hosts, emulated: a draft model's proposals recorded alone, replayed by the clients.

Why: the use case of a shared target is drafts made on the users' own devices. On one small box,
eight client processes each running a draft model take the cores the worker needs (and their
memory), so a measurement of chain SD under load would measure that contention. Instead the draft
runs once, alone, in the benchmark's process (`record`), and each client replays, for the context it
is at, the tokens the draft proposed there, after sleeping the seconds it took: the worker sees the
same verify requests (greedy: the same contexts, step by step), and each client's step takes the
draft's time without using a core here. A context never met alone (a batched near-tie that took a
greedy output elsewhere: bf16) is counted as a miss and drafts one token, which verification
judges like any other, after sleeping the recorded proposals' median time: a miss costs its client a
draft's time, as on a real device, rather than making it instant; the output stays the target's.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.types import DraftTree


def context_key(context: Sequence[int], k: int, max_depth: Optional[int]) -> tuple:
    """What a proposal depends on: the context, the budget and the depth cap."""
    return len(context), hash(tuple(context)), k, max_depth


class RecordingDrafter:
    """Wraps a drafter; keeps each proposal's tokens, parents and seconds by the context it was made for."""

    def __init__(self, inner):
        self.inner, self.name, self.proposals = inner, inner.name, {}

    def propose(self, context, k, sampling, draws, max_depth=None) -> DraftTree:
        started = time.perf_counter()
        tree = self.inner.propose(context, k, sampling, draws, max_depth)
        self.proposals[context_key(context, k, max_depth)] = (tree.tokens, tree.parents, time.perf_counter() - started)
        return tree


class ReplayDrafter:
    """Proposes what the recorded draft proposed for this context, as slowly as it did."""

    name = "replayed-draft"

    def __init__(self, proposals: dict):
        self.proposals, self.misses = proposals, 0
        seconds = sorted(found[2] for found in proposals.values())
        self.miss_s = seconds[len(seconds) // 2] if seconds else 0.0  # a miss drafts for the median time

    def propose(self, context, k, sampling, draws, max_depth=None) -> DraftTree:
        found = self.proposals.get(context_key(context, k, max_depth))
        if found is None:
            self.misses += 1
            time.sleep(self.miss_s)
            return DraftTree.chain((context[-1],), None)
        tokens, parents, seconds = found
        time.sleep(seconds)
        return DraftTree(tuple(tokens), tuple(parents))


def record(target: LocalTarget, drafter, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int) -> dict:
    """Every proposal `drafter` makes decoding `prompts` greedily against `target`, alone."""
    recording = RecordingDrafter(drafter)
    for index, prompt in enumerate(prompts):
        generate(target, recording, prompt, Decoding(k, max_new_tokens, method="chain", kind="chain"),
                 prompt_index=index, session=f"record-{index}")
    return recording.proposals


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
