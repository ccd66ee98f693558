"""Forward latency of a causal LM over a grid of (tokens per forward, context length).

Why: latency depends on shapes, not weight values, so these grids (measured anywhere, even with
random weights of the real architecture) predict how much a verify of K tokens costs.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from specbench.decode.kv import crop_to


@torch.inference_mode()
def forward_latency_grid(model, tokens: Sequence[int], contexts: Sequence[int], repeats: int = 5,
                         warmup: int = 2) -> list[dict]:
    """Median (and spread) seconds of one forward of `n` new tokens on a cache of `c` positions."""
    from transformers import DynamicCache

    if repeats < 1 or any(n < 1 for n in tokens) or any(c < 1 for c in contexts):
        raise ValueError("repeats, tokens and contexts must all be >= 1")
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        cache = DynamicCache(config=model.config)
        prefix = torch.randint(0, vocab, (1, context), generator=generator).to(device)
        model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for count in tokens:
            new = torch.randint(0, vocab, (1, count), generator=generator).to(device)
            samples = []
            for attempt in range(warmup + repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                model(input_ids=new, past_key_values=cache, use_cache=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if attempt >= warmup:
                    samples.append(time.perf_counter() - start)
                crop_to(cache, context)
            samples.sort()
            rows.append({"tokens": count, "context": context, "median_s": statistics.median(samples),
                         "min_s": samples[0], "max_s": samples[-1], "repeats": repeats})
    return rows
