"""KV-cache bookkeeping: one committed length per sequence; rollback is cropping to it.

Why a helper: `DynamicCache.crop` takes the number of tokens to DROP (negative) in transformers 5,
and compacting an accepted tree path needs a gather along the sequence axis of every layer.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from specbench.types import SpecbenchError


def common_prefix(cached: Sequence[int], context: Sequence[int]) -> int:
    """How many leading tokens two sequences share: what a drafter's cache of `cached` may keep for `context`."""
    common = 0
    for kept, token in zip(cached, context):
        if kept != token:
            break
        common += 1
    return common


def cached_length(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def plain_layers(config) -> bool:
    """Whether every layer of `config`'s default cache is a plain growing one (full attention): what
    a pool row, a static cache or a copied batch cache can stand in for. Not so with a sliding window
    (Gemma 3) or linear attention."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def new_cache(config):
    """An empty `DynamicCache` that can be rolled back. Sliding-window layers (Gemma 3) otherwise drop
    positions past their window as they go, and a rejected draft beyond the window could not be
    cropped; recording keeps them until the next `crop_to` trims the layer back to its window."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return cache


def check_full_attention(model, what: str) -> None:
    """Token trees attend through a custom mask, which sliding-window layers (Gemma 3) do not take:
    refuse them there, naming what works instead."""
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        raise SpecbenchError(f"{what}: token trees need full-attention layers, and this model has "
                             f"sliding-window layers (e.g. Gemma 3); use a chain method instead")


def can_crop_to(cache, length: int) -> bool:
    """Whether every sliding-window layer still holds the window that ends at `length` (it holds the
    positions since its last crop plus a window before them; a deeper rollback needs a re-feed)."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, "record_past", False) and layer.keys is not None:
            held_from = layer.cumulative_length - layer.keys.shape[2]
            if max(0, length - layer.sliding_window + 1) < held_from:
                return False
    return True


def crop_to(cache, length: int) -> None:
    """Keep the first `length` positions of every layer (a sliding-window layer: of those, its window)."""
    excess = cached_length(cache) - length
    if excess < 0:
        raise ValueError(f"cannot crop a cache of {cached_length(cache)} positions up to {length}")
    if not can_crop_to(cache, length):
        raise ValueError(f"cannot crop a cache of {cached_length(cache)} positions back to {length}: its "
                         f"sliding-window layers no longer hold the positions before the last step")
    if excess or (length and _sliding(cache)):
        cache.crop(-excess)  # crop(0) trims a recording sliding-window layer back to its window


def _sliding(cache) -> bool:
    return any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", ()))


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
        if hasattr(layer, "cumulative_length"):  # sliding window: it holds only the last positions
            first = layer.cumulative_length - layer.keys.shape[2]
            local = torch.as_tensor([p - first for p in positions if p >= first], dtype=torch.long)
            device_index = local.to(layer.keys.device)
            layer.cumulative_length = len(positions)
        else:
            device_index = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(2, device_index)
        layer.values = layer.values.index_select(2, device_index)
    if _sliding(cache):
        cache.crop(0)  # back to the window


def tree_attention_mask(parents: Sequence[int], num_prefix: int, past: int,
                        dtype: torch.dtype, device) -> torch.Tensor:
    """Float 4D mask [1, 1, num_prefix + nodes, past + num_prefix + nodes]: 0 allowed, dtype-min not.

    The first `num_prefix` inputs are committed tokens not yet cached (causal among themselves);
    each tree node sees all of them, its ancestors and itself. Example: parents (-1, -1, 0) gives
    node 2 the columns of node 0 and itself, and node 1 only itself.
    """
    total = num_prefix + len(parents)
    block = _tree_block(tuple(parents), num_prefix, dtype)
    mask = torch.cat([torch.zeros(total, past, dtype=dtype), block], dim=1)
    return mask.view(1, 1, total, past + total).to(device)


@functools.lru_cache(maxsize=512)
def _tree_block(parents: tuple, num_prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask's columns of the new inputs, [total, total] additive: the same for every step that
    drafts the same tree shape (a chain of K, a fixed tree), so it is built once per shape. Cached
    per step (~70 us of Python per row of every batch before); callers get copies, never this one."""
    total = num_prefix + len(parents)
    allowed = torch.tril(torch.ones(total, total, dtype=torch.bool))
    allowed[num_prefix:, num_prefix:] = False
    for i, parent in enumerate(parents):
        row = num_prefix + i
        allowed[row, row] = True
        if parent >= 0:
            allowed[row, num_prefix:] |= allowed[num_prefix + parent, num_prefix:]
    block = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    return block.masked_fill_(allowed, 0.0)
