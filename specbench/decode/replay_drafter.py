"""Drafts on other hosts, emulated: a drafter's proposals recorded alone, replayed by clients at load.

Why: a shared target serves users who draft on their own devices. On one small box, N clients each
running a draft model take the cores the worker needs, so a measurement of SD under load would
measure that contention. Instead the draft runs alone (one client, `RecordingDrafter`), and each
client at load replays, for the context it is at, the tokens the draft proposed there after sleeping
the seconds it took (`ReplayDrafter`): the worker sees the same verify requests (greedy: the same
contexts, step by step) and each client's step takes the draft's time without using a core here. A
context never met alone (a batched near-tie took a greedy output elsewhere) is a counted miss that the
wrapped drafter (`fallback`) drafts for real, bound to the session as the loop binds it (a draft head
reads the target's features: the worker sends them every step, as to a real client-side head); without
one, a miss drafts one token after sleeping the recorded proposals' median time. Either way verification
judges it like any other, so the output stays the target's. Why for real: once a request parts from its
lone run, every later context of it misses, and one-token drafts there measured the Qwen pair's loaded
points with 17-20% of their steps drafting nothing (bf16, 2026-12-07). Greedy only: a replay carries no
draft distributions.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Optional, Sequence

from specbench.files import write_text
from specbench.types import DraftTree, SpecbenchError


def context_key(context: Sequence[int], k: int, max_depth: Optional[int]) -> str:
    """What a proposal depends on: the context (digested: the same in every process), the budget, the depth cap."""
    digest = hashlib.blake2b(",".join(map(str, context)).encode(), digest_size=12).hexdigest()
    return f"{len(context)}:{digest}:{k}:{max_depth}"


class RecordingDrafter:
    """Wraps a drafter; keeps each proposal's tokens, parents, seconds and source (which of a hybrid's drafters made
    it) by the context it was made for."""

    def __init__(self, inner, proposals: Optional[dict] = None):
        self.inner = inner
        self.proposals = {} if proposals is None else proposals

    def propose(self, context, k, sampling, draws, max_depth=None) -> DraftTree:
        if not sampling.greedy:
            raise SpecbenchError("recorded drafts replay greedy decoding only (a replay keeps no draft distributions)")
        started = time.perf_counter()
        tree = self.inner.propose(context, k, sampling, draws, max_depth)
        self.proposals[context_key(context, k, max_depth)] = (list(tree.tokens), list(tree.parents),
                                                               time.perf_counter() - started, tree.source)
        return tree

    def __getattr__(self, name):  # name, draft, finish, bind, warm, ...: the wrapped drafter's own
        if "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)


class ReplayDrafter:
    """Proposes what the recorded draft proposed for this context, as slowly as it did; a context never met alone
    goes to `fallback` (the wrapped drafter)."""

    name = "replayed-draft"

    def __init__(self, proposals: dict, draft=None, fallback=None):
        if not proposals:
            raise SpecbenchError("no recorded proposals to replay: record the draft alone first")
        self.proposals, self.misses, self.draft, self.fallback = proposals, 0, draft, fallback
        seconds = sorted(found[2] for found in proposals.values())
        self.miss_s = seconds[len(seconds) // 2]  # a miss drafts for the median time, as a real draft would

    def propose(self, context, k, sampling, draws, max_depth=None) -> DraftTree:
        if not sampling.greedy:
            raise SpecbenchError("recorded drafts replay greedy decoding only (a replay keeps no draft distributions)")
        found = self.proposals.get(context_key(context, k, max_depth))
        if found is None:
            self.misses += 1
            if self.fallback is not None:
                return self.fallback.propose(context, k, sampling, draws, max_depth)
            time.sleep(self.miss_s)
            return DraftTree.chain((context[-1],), None)
        tokens, parents, seconds, source = found
        time.sleep(seconds)
        return DraftTree(tuple(tokens), tuple(parents), source=source)

    def bind(self, target, session: str) -> None:
        """The loop's bind, to a fallback that reads the target's session (a draft head: the target keeps, and a worker
        sends, its features, as for the head recorded alone)."""
        if hasattr(self.fallback, "bind"):
            self.fallback.bind(target, session)

    def finish(self, context) -> None:
        """The end of a request, to the fallback that keeps outputs (suffix decoding's cache), as the loop gives it."""
        if hasattr(self.fallback, "finish"):
            self.fallback.finish(context)


def save_proposals(path: Path, proposals: dict) -> None:
    """Whole or absent: a kill mid-write leaves no half file."""
    write_text(path, json.dumps(proposals))


def load_proposals(path: Path) -> Optional[dict]:
    path = Path(path)
    if not path.exists():
        return None
    try:
        loaded = json.loads(path.read_text())
        # (proposals recorded before sources were kept: three fields, no source)
        return {key: (list(found[0]), list(found[1]), float(found[2]), str(found[3]) if len(found) > 3 else "")
                for key, found in loaded.items()}
    except (ValueError, TypeError, AttributeError, IndexError) as error:  # AttributeError: JSON that is no object
        raise SpecbenchError(f"recorded proposals {path} are unreadable ({error}): delete the file to record again")


def record(target, drafter, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int) -> dict:
    """Every proposal `drafter` makes decoding `prompts` greedily against `target`, alone."""
    from specbench.decode.loop import Decoding, generate

    recording = RecordingDrafter(drafter)
    for index, prompt in enumerate(prompts):
        generate(target, recording, prompt, Decoding(k, max_new_tokens, method="chain", kind="chain"),
                 prompt_index=index, session=f"record-{index}")
    return recording.proposals
