"""A batch grid timed as a shared worker verifies it: packed rows of the target's own pool.

Why: `decode/profile.py` times B sequences as Hugging Face's forward over one batched cache, while a
worker on a packed target verifies its clients' rows packed into one sequence, each reading its own pool
row (`decode/batch.py`). On the 2-core VM of 2026-11-27 the Qwen 1.5B's 8-row verify took 0.596 s in a run
and the unpacked grid priced it 0.696 s, so tune predicted 8 clients 13-17% slow
(benchmarks/results/2026-11-27-tune-loaded-simulation.md). Here each point's B sessions are prefilled
with random tokens (the last one their tail) and verify random chains of `tokens - 1` drafts through
`verify_batch`, the forward's own time read from the verdicts; after each repeat every session is put back
as it was (its committed tokens, tail and pool row length), so every repeat verifies on the same contexts.
Two things make the grid time rounds as a worker meets them (on the 2-core VM, the Qwen 1.5B in bf16, 4 rows
of 3 tokens: 171 ms repeated alone on one context, 187 ms as a loop runs them, against 188-203 ms in loaded
runs; benchmarks/results/2026-11-27-tune-qwen-issue-size.md): the B rows sit at contexts spread evenly over
half to one and a half times the point's (clients are at different points of different prompts; their mean
is the point's context), and the repeats go round the grid's token counts in turn rather than one count
at a time (a loop's rounds change shape from one to the next).
"""
from __future__ import annotations

import statistics
import uuid
from typing import Iterator, Optional, Sequence

import torch

from specbench.types import DraftTree, SamplingParams


def packed_batch_steps(target, tokens: Sequence[int], contexts: Sequence[int], repeats: int = 5, warmup: int = 2,
                       batches: Sequence[int] = (2,), slice_tokens: Optional[int] = None,
                       longest: Optional[int] = None) -> Iterator[Optional[dict]]:
    """Rows (tokens, context, batch, median_s, ...) as `forward_latency_steps` yields them, None after each
    piece of work (a prefill chunk, one timed repeat), for `batches` of a packed LocalTarget; no row's prompt
    longer than `longest` (a worker's `--max-prompt-tokens`) nor than the model's context less the widest
    verify."""
    from specbench.decode.batch import VerifyRequest, verify_batch
    from specbench.decode.kv import cached_length

    generator = torch.Generator().manual_seed(0)
    run = uuid.uuid4().hex[:12]  # two profiles under way on one worker (two tenants) never share a session
    bounds = [b for b in (longest, target.max_context and target.max_context - max(tokens)) if b]
    room = min(bounds) if bounds else None
    for batch, context in ((b, c) for b in batches for c in contexts):
        names = [f"profile-packed-{run}-{batch}-{context}-{i}" for i in range(batch)]
        try:
            for name, length in zip(names, spread(context, batch, room)):
                job = target.prefill_job(name, torch.randint(0, target.vocab_size, (length,),
                                                             generator=generator).tolist())
                while not job.advance(slice_tokens or length):
                    yield None
            samples: dict = {count: [] for count in tokens}
            for attempt in range(warmup + repeats):
                for count in tokens:
                    requests = [VerifyRequest(name, DraftTree.chain(torch.randint(
                        0, target.vocab_size, (count - 1,), generator=generator).tolist()), SamplingParams(), 0)
                        for name in names]
                    states = [target.state(name) for name in names]
                    kept = [(list(s.committed), list(s.tail), cached_length(s.cache)) for s in states]
                    verdicts = verify_batch(target, requests)
                    for state, (committed, tail, length) in zip(states, kept):
                        state.committed, state.tail = committed, tail
                        state.cache.set_length(length)
                    failed = next((v for v in verdicts if isinstance(v, Exception)), None)
                    if failed is not None:
                        raise failed
                    if attempt >= warmup:
                        samples[count].append(verdicts[0].timing.target_forward_s)
                    yield None
            for count in tokens:
                timed = sorted(samples[count])
                yield {"tokens": count, "context": context, "batch": batch, "median_s": statistics.median(timed),
                       "min_s": timed[0], "max_s": timed[-1], "repeats": repeats}
        finally:
            for name in names:
                target.close(name)


def spread(context: int, batch: int, room: int | None = None) -> list[int]:
    """Prompt lengths of `batch` rows around `context` (the tail included: `context - 1` cached on average),
    evenly from half to one and a half times it, each at least 2, narrower where the longest would pass `room`
    (the longest prompt allowed). Example: spread(100, 3) == [50, 100, 150]."""
    context = max(context, 2)
    half = context // 2 if room is None else max(0, min(context // 2, room - context))
    if batch == 1:
        return [context]
    return [max(2, round(context - half + 2 * half * i / (batch - 1))) for i in range(batch)]
