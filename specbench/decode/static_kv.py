"""A fixed-capacity KV cache for one sequence, written at absolute positions: what a compiled or
graph-captured forward needs.

Why: a growing cache changes every tensor's shape each step, so a compiled forward recompiles and a
CUDA graph cannot be captured at all. Here each layer's keys and values are allocated once,
[1, kv_heads, capacity, head_dim], at a fixed address; a forward writes its new positions in place at
`write_index` and attends over the first `width` positions (a multiple of `WIDTH_STEP`, so a handful of
widths cover a whole generation and attention never reads the empty rest). Rollback is bookkeeping
(`length`); an accepted tree path is compacted in place (`keep`). Positions past `length` hold whatever a
rejected draft or a padded step wrote there: never attended, since every mask stops at the row's own
positions (`decode/fast_forward.py`).
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specbench.types import SpecbenchError

WIDTH_STEP = 128  # positions; attention reads the cache up to a multiple of it


def rounded(positions: int) -> int:
    """`positions` rounded up to whole `WIDTH_STEP`s: a static cache's capacity."""
    return -(-positions // WIDTH_STEP) * WIDTH_STEP


def static_bytes(config, capacity: int, dtype: torch.dtype) -> int:
    """Bytes a static cache of `capacity` positions holds (keys and values, every layer), before it exists."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * head_dim * rounded(capacity) * torch.empty((), dtype=dtype).element_size()


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config, or a clear refusal where it cannot say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return text.num_hidden_layers, kv_heads, head_dim
    except AttributeError as missing:
        raise SpecbenchError(f"fast forward: cannot size a static cache for {type(config).__name__} "
                             f"({missing}); run with fast=False") from None


class StaticKV(Cache):
    """A session's keys and values at fixed addresses; `length` positions are committed."""

    def __init__(self, config, capacity: int, dtype: torch.dtype, device):
        layers, kv_heads, head_dim = kv_shape(config)
        if capacity < 1:
            raise SpecbenchError(f"static cache capacity must be >= 1 position, got {capacity}")
        self.capacity = rounded(capacity)
        shape = (1, kv_heads, self.capacity, head_dim)
        with torch.inference_mode():
            self.key_store = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.value_store = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0
        self.width = WIDTH_STEP  # what the next forward attends over, set by `prepare`
        self.write_index = torch.zeros(1, dtype=torch.long, device=device)
        super().__init__(layers=[StaticKVLayer(self, index) for index in range(layers)])

    def prepare(self, write_index: torch.Tensor, end: int) -> None:
        """Before a forward: its new positions go to `write_index`; it attends up to position `end`."""
        if end > self.capacity:
            raise SpecbenchError(f"sequence of {end} positions exceeds the static cache's capacity of "
                                 f"{self.capacity} (raise fast_capacity)")
        self.write_index = write_index
        self.width = width_for(end, self.capacity)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """transformers' convention: a negative argument drops that many positions."""
        self.length = max(0, self.length + max_length) if max_length < 0 else min(self.length, max_length)

    def set_length(self, length: int) -> None:
        self.length = length

    @torch.inference_mode()
    def keep(self, positions: Sequence[int]) -> None:
        """Keep only `positions` (ascending), in place: what stays where it is is not copied."""
        first = next((i for i, p in enumerate(positions) if p != i), len(positions))
        if first < len(positions):
            tail = torch.as_tensor(list(positions[first:]), dtype=torch.long, device=self.key_store[0].device)
            for store in (self.key_store, self.value_store):
                for layer in store:
                    layer[:, :, first:len(positions)] = layer.index_select(2, tail)
        self.length = len(positions)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_store + self.value_store)


def width_for(end: int, capacity: int) -> int:
    """The attended width for a forward ending at position `end`: the next multiple of WIDTH_STEP."""
    return min(capacity, max(WIDTH_STEP, -(-end // WIDTH_STEP) * WIDTH_STEP))


class StaticKVLayer(CacheLayerMixin):
    """Layer `index` of a `StaticKV`: writes at the cache's `write_index`, returns its first `width`."""

    is_compileable = True
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: StaticKV, index: int):  # noqa: the mixin's __init__ would reset keys
        self.cache, self.index = cache, index
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.cache.key_store[self.index][:, :, :self.cache.length]

    @property
    def values(self) -> torch.Tensor:
        return self.cache.value_store[self.index][:, :, :self.cache.length]

    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # allocated up front, so the addresses never change

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.cache.key_store[self.index], self.cache.value_store[self.index]
        keys.index_copy_(2, self.cache.write_index, key_states)
        values.index_copy_(2, self.cache.write_index, value_states)
        width = self.cache.width
        return keys[:, :, :width], values[:, :, :width]

    def get_seq_length(self) -> int:
        return self.cache.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.width, 0

    def get_max_length(self) -> int:
        return self.cache.capacity

    def crop(self, max_length: int) -> None:
        self.cache.crop(max_length)

    def reset(self) -> None:
        self.cache.length = 0
