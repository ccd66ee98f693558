"""KV-cache bookkeeping: one committed length per sequence; rollback is cropping to it.

Why a helper: `DynamicCache.crop` takes the number of tokens to DROP (negative) in transformers 5,
and compacting an accepted tree path needs a gather along the sequence axis of every layer.
"""
from __future__ import annotations

from typing import Sequence

import torch


def cached_length(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def crop_to(cache, length: int) -> None:
    """Keep the first `length` positions of every layer."""
    excess = cached_length(cache) - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cached_length(cache)} positions up to {length}")
    if excess:
        cache.crop(-excess)


def keep_positions(cache, positions: Sequence[int]) -> None:
    """Keep only `positions` (ascending) of every layer, in place: compacts an accepted tree path."""
    if list(positions) == list(range(len(positions))):
        crop_to(cache, len(positions))
        return
    if hasattr(cache, "keep"):  # a pooled cache compacts its own row in place
        cache.keep(positions)
        return
    index = torch.as_tensor(list(positions), dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        device_index = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(2, device_index)
        layer.values = layer.values.index_select(2, device_index)


def tree_attention_mask(parents: Sequence[int], num_prefix: int, past: int,
                        dtype: torch.dtype, device) -> torch.Tensor:
    """Float 4D mask [1, 1, num_prefix + nodes, past + num_prefix + nodes]: 0 allowed, dtype-min not.

    The first `num_prefix` inputs are committed tokens not yet cached (causal among themselves);
    each tree node sees all of them, its ancestors and itself. Example: parents (-1, -1, 0) gives
    node 2 the columns of node 0 and itself, and node 1 only itself.
    """
    nodes = len(parents)
    total = num_prefix + nodes
    allowed = torch.zeros(total, past + total, dtype=torch.bool)
    allowed[:, :past] = True
    allowed[:, past:past + num_prefix] = torch.tril(torch.ones(total, num_prefix, dtype=torch.bool))
    for i, parent in enumerate(parents):
        row = num_prefix + i
        allowed[row, past + row] = True
        if parent >= 0:
            allowed[row, past + num_prefix:] |= allowed[num_prefix + parent, past + num_prefix:]
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    mask.masked_fill_(allowed, 0.0)
    return mask.view(1, 1, total, past + total).to(device)
