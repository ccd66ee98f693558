"""Forward latency of a causal LM over a grid of (tokens per forward, context length, batch size).

Why: latency depends on shapes, not weight values, so these grids (measured anywhere, even with
random weights of the real architecture) predict how much a verify of K tokens costs, and a batch
of B sequences what a worker shared by B clients pays for one batched verify.
"""
from __future__ import annotations

import statistics
from typing import Iterator, Optional, Sequence

import torch

from specbench.decode.clock import device_time
from specbench.decode.kv import crop_to, new_cache
from specbench.types import SpecbenchError


def forward_latency_grid(model, tokens: Sequence[int], contexts: Sequence[int], repeats: int = 5,
                         warmup: int = 2, batches: Sequence[int] = (1,), fast: bool | str | None = None) -> list[dict]:
    """Median (and spread) seconds of one forward of `n` new tokens on a cache of `c` positions, for
    `b` sequences at once (each with its own cache rows, as a shared worker's batched verify).
    `fast`: True or a backend of `decode/fast_forward.py` (static caches, fixed shapes, batched), timed
    after its warm-up calls have compiled or captured the shape."""
    return list(forward_latency_points(model, tokens, contexts, repeats, warmup, batches, fast))


def forward_latency_points(model, tokens: Sequence[int], contexts: Sequence[int], repeats: int = 5,
                           warmup: int = 2, batches: Sequence[int] = (1,),
                           fast: bool | str | None = None) -> Iterator[dict]:
    """The grid's rows one at a time."""
    steps = forward_latency_steps(model, tokens, contexts, repeats, warmup, batches, fast)
    return (row for row in steps if row is not None)


def forward_latency_steps(model, tokens: Sequence[int], contexts: Sequence[int], repeats: int = 5,
                          warmup: int = 2, batches: Sequence[int] = (1,), fast: bool | str | None = None,
                          slice_tokens: int | None = None) -> Iterator[Optional[dict]]:
    """The grid as pieces of bounded work: None after each forward (a piece of a context being built,
    `slice_tokens` positions of all its rows at most, or one timed repeat), a row after each point's
    last repeat. A shared worker serves other clients between pieces: a whole point (20 repeats of
    256 tokens on a 4,096-token context) held every other client for minutes."""
    if repeats < 1 or any(n < 1 for n in tokens) or any(c < 1 for c in contexts) or any(b < 1 for b in batches):
        raise SpecbenchError(f"repeats, tokens, contexts and batches must all be >= 1, got {repeats}, {list(tokens)}, "
                             f"{list(contexts)}, {list(batches)}")
    longest = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(longest, int) and max(contexts) + max(tokens) > longest:  # past it: minutes of a meaningless point
        raise SpecbenchError(f"a context of {max(contexts)} plus {max(tokens)} new tokens passes the model's "
                             f"{longest} positions: profile contexts up to {longest - max(tokens)}")
    if fast:
        yield from _fast_points(model, tokens, contexts, repeats, warmup, batches, fast, slice_tokens)
        return
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    # the grid's first point warms up twice as long: a worker's first forwards can run cold (the Qwen 1.5B in bf16
    # on the 2-core VM timed its first point, 1 token, at 330 ms after 2 warm-ups; the next at 136)
    cold = warmup + repeats
    for batch, context in ((b, c) for b in batches for c in contexts):
        cache = new_cache(model.config)
        prefix = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
        for start in range(0, context, _piece(slice_tokens, batch, context)):  # the context, a piece at a time
            end = min(context, start + _piece(slice_tokens, batch, context))
            with torch.inference_mode():
                model(input_ids=prefix[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1)
            yield None
        for count in tokens:
            new = torch.randint(0, vocab, (batch, count), generator=generator).to(device)
            samples, untimed, cold = [], warmup + cold, 0
            for attempt in range(untimed + repeats):
                start = device_time(device)
                with torch.inference_mode():
                    model(input_ids=new, past_key_values=cache, use_cache=True)
                if attempt >= untimed:
                    samples.append(device_time(device) - start)
                crop_to(cache, context)
                if attempt + 1 < untimed + repeats:
                    yield None
            samples.sort()
            yield {"tokens": count, "context": context, "batch": batch, "median_s": statistics.median(samples),
                   "min_s": samples[0], "max_s": samples[-1], "repeats": repeats}


def _piece(slice_tokens: int | None, batch: int, context: int) -> int:
    """Context positions per piece: `slice_tokens` over the batch's rows (at least one), or all of it."""
    return max(1, slice_tokens // batch) if slice_tokens else context


def _fast_points(model, tokens, contexts, repeats, warmup, batches, backend, slice_tokens) -> Iterator[Optional[dict]]:
    """The grid through the fast path: `b` static caches (pool rows), one fixed-shape forward of them all
    (`FastForward.batch`; one sequence alone as a lone step), rolled back to `context` after each."""
    from specbench.decode.fast_forward import FastForward

    forward = FastForward(model, max(contexts) + max(tokens), backend)
    forward.pool.reserve_slots(max(batches) + 1)  # (+ a padding row) the tensors stay put: no recompile mid-grid
    device, vocab = forward.device, model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    for batch, context in ((b, c) for b in batches for c in contexts):
        caches = [forward.new_cache() for _ in range(batch)]
        for cache in caches:
            prefix = torch.randint(0, vocab, (context,), generator=generator).tolist()
            piece = slice_tokens or context
            for start in range(0, context, piece):
                forward(cache, prefix[start:start + piece], logits_to_keep=1)
                yield None
        for count in tokens:
            new = [torch.randint(0, vocab, (count,), generator=generator).tolist() for _ in caches]
            where = [list(range(context, context + count))] * batch
            mask = torch.zeros(count, context + count, dtype=model.dtype)
            mask[:, context:] = torch.full((count, count), torch.finfo(model.dtype).min).triu(1)
            samples = []
            for attempt in range(max(warmup, 1) + repeats):  # the first call compiles or captures
                start = device_time(device)
                forward.batch(caches, new, where, [mask] * batch)
                if attempt >= max(warmup, 1):
                    samples.append(device_time(device) - start)
                for cache in caches:
                    cache.set_length(context)
                if attempt + 1 < max(warmup, 1) + repeats:
                    yield None
            samples.sort()
            yield {"tokens": count, "context": context, "batch": batch, "median_s": statistics.median(samples),
                   "min_s": samples[0], "max_s": samples[-1], "repeats": repeats, "forward": f"fast-{forward.backend}"}
        for cache in caches:
            cache.free()


def spread(rows: Sequence[dict]) -> Optional[float]:
    """How much a profile's repeats spread: the median over its points of (max - min) / median.
    Example: points timed (min, median, max) = (50, 51, 53) and (80, 90, 140) ms spread 0.06 and 0.67:
    0.36, a busy machine (`plan.library.NOISY_SPREAD`). None for rows without min/max."""
    import statistics

    ratios = [(r["max_s"] - r["min_s"]) / r["median_s"] for r in rows
              if r.get("median_s") and "min_s" in r and "max_s" in r]
    return round(statistics.median(ratios), 4) if ratios else None
