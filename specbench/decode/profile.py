"""Forward latency of a causal LM over a grid of (tokens per forward, context length, batch size).

Why: latency depends on shapes, not weight values, so these grids (measured anywhere, even with
random weights of the real architecture) predict how much a verify of K tokens costs, and a batch
of B sequences what a worker shared by B clients pays for one batched verify.
"""
from __future__ import annotations

import statistics
from typing import Iterator, Sequence

import torch

from specbench.decode.clock import device_time
from specbench.decode.kv import crop_to, new_cache


def forward_latency_grid(model, tokens: Sequence[int], contexts: Sequence[int], repeats: int = 5,
                         warmup: int = 2, batches: Sequence[int] = (1,)) -> list[dict]:
    """Median (and spread) seconds of one forward of `n` new tokens on a cache of `c` positions, for
    `b` sequences at once (each with its own cache rows, as a shared worker's batched verify)."""
    return list(forward_latency_points(model, tokens, contexts, repeats, warmup, batches))


def forward_latency_points(model, tokens: Sequence[int], contexts: Sequence[int], repeats: int = 5,
                           warmup: int = 2, batches: Sequence[int] = (1,)) -> Iterator[dict]:
    """The grid's rows one at a time, so a shared worker can serve other clients between points."""
    if repeats < 1 or any(n < 1 for n in tokens) or any(c < 1 for c in contexts) or any(b < 1 for b in batches):
        raise ValueError("repeats, tokens, contexts and batches must all be >= 1")
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    for batch, context in ((b, c) for b in batches for c in contexts):
        cache = new_cache(model.config)
        prefix = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
        with torch.inference_mode():
            model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for count in tokens:
            new = torch.randint(0, vocab, (batch, count), generator=generator).to(device)
            samples = []
            for attempt in range(warmup + repeats):
                start = device_time(device)
                with torch.inference_mode():
                    model(input_ids=new, past_key_values=cache, use_cache=True)
                if attempt >= warmup:
                    samples.append(device_time(device) - start)
                crop_to(cache, context)
            samples.sort()
            yield {"tokens": count, "context": context, "batch": batch, "median_s": statistics.median(samples),
                   "min_s": samples[0], "max_s": samples[-1], "repeats": repeats}
