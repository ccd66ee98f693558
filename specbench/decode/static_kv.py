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

import gc
import weakref
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specbench.decode.slot_pool import SlotPool
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


class StaticPool(SlotPool):
    """Every static cache of one model: per layer one [slots, kv_heads, capacity, head_dim] tensor, a
    row (slot) per session.

    Why: a batched forward at fixed shapes reads and writes its sessions' rows by slot index in one
    tensor per layer (`FastForward.batch`): a compiled graph takes the pool as one input whatever the
    sessions, and a CUDA graph replays at its fixed addresses. Slots grow by doubling where `max_bytes`
    allows, else one at a time; growing moves the tensors (`generation` counts it, so graphs captured
    at the old addresses are dropped). A slot returns when its cache is freed (a session closed) or
    collected."""

    def __init__(self, config, capacity: int, dtype: torch.dtype, device):
        self.layers, self.kv_heads, self.head_dim = kv_shape(config)
        if capacity < 1:
            raise SpecbenchError(f"static cache capacity must be >= 1 position, got {capacity}")
        self.capacity, self.dtype, self.device = rounded(capacity), dtype, device
        self.slot_bytes = static_bytes(config, capacity, dtype)
        super().__init__(0)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.generation = 0
        self.max_bytes: Optional[int] = None  # every slot together (the worker's --max-kv-gib)

    def _grow_slots(self) -> None:
        self._grow()

    def reserve_slots(self, slots: int) -> None:
        """Grow now to `slots` slots (if it has fewer), so later sessions find the tensors where they are."""
        if slots > self.slots:
            self._grow(slots)

    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def _grow(self, wanted: Optional[int] = None) -> None:
        """`wanted` slots, or one more at least (doubling where it fits), all-or-nothing: every new tensor
        exists before any old one is let go."""
        needed = wanted or self.slots + 1
        if self.max_bytes and needed * self.slot_bytes > self.max_bytes:
            gc.collect()  # a dropped cache is a reference cycle (cache <-> its layers) until collected
            if self._free:
                return
            raise SpecbenchError(
                f"static KV caches: {self.in_use} sessions hold {self.nbytes()} bytes and one more needs "
                f"{self.slot_bytes} ({self.capacity} positions), over the limit of {self.max_bytes} bytes "
                f"(the worker's --max-kv-gib); close sessions or lower fast_capacity")
        doubled = wanted or max(needed, 2 * self.slots)
        grown = doubled if not self.max_bytes or doubled * self.slot_bytes <= self.max_bytes else needed
        shape = (grown, self.kv_heads, self.capacity, self.head_dim)
        with torch.inference_mode():
            new = [[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
                   for _ in range(2)]
            for store, old_store in zip(new, (self.keys, self.values)):
                for tensor, old in zip(store, old_store):
                    tensor[:self.slots] = old
        self.keys, self.values = new
        self._added(grown)
        self.generation += 1


class StaticKV(Cache):
    """A session's keys and values: row `slot` of a `StaticPool`; `length` positions are committed."""

    def __init__(self, pool: StaticPool):
        self.pool, self.slot = pool, pool.acquire()
        self.capacity = pool.capacity
        self.length = 0
        self.width = WIDTH_STEP  # what the next forward attends over, set by `prepare`
        self.write_index = torch.zeros(1, dtype=torch.long, device=pool.device)
        self._views = (-1, [], [])  # (pool generation, key rows, value rows)
        super().__init__(layers=[StaticKVLayer(self, index) for index in range(pool.layers)])
        self.free = weakref.finalize(self, pool.release, self.slot)  # at most once: on close, or when collected

    @property
    def key_store(self) -> list[torch.Tensor]:
        """Per layer [1, kv_heads, capacity, head_dim]: this session's row of the pool (a view)."""
        return self._rows()[0]

    @property
    def value_store(self) -> list[torch.Tensor]:
        return self._rows()[1]

    def _rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._views[0] != self.pool.generation:  # made once per pool generation, not per layer call
            row = slice(self.slot, self.slot + 1)
            self._views = (self.pool.generation, [k[row] for k in self.pool.keys], [v[row] for v in self.pool.values])
        return self._views[1], self._views[2]

    def prepare(self, write_index: torch.Tensor, end: int) -> None:
        """Before a forward: its new positions go to `write_index`; it attends up to position `end`."""
        if end > self.capacity:
            raise SpecbenchError(f"sequence of {end} positions exceeds the static cache's capacity of "
                                 f"{self.capacity} (raise fast_capacity)")
        self.write_index = write_index
        self.width = width_for(end, self.capacity)
        self._rows()  # the row views exist before a compiled or captured forward reads them

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
            tail = torch.as_tensor(list(positions[first:]), dtype=torch.long, device=self.pool.device)
            for store in self._rows():
                for layer in store:
                    layer[:, :, first:len(positions)] = layer.index_select(2, tail)
        self.length = len(positions)

    def nbytes(self) -> int:
        return self.pool.slot_bytes


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


class PoolBatch(Cache):
    """The cache of one batched forward over pool rows: row r of the batch is slot `slot_index[r]`, its
    new keys and values go to that slot at positions `write_index[r]`, and it attends over the slot's
    first `width` positions (the batch's 4D mask says which of them)."""

    def __init__(self, pool: StaticPool, slot_index: torch.Tensor, write_index: torch.Tensor, width: int):
        self.pool, self.slot_index, self.write_index, self.width = pool, slot_index, write_index, width
        super().__init__(layers=[PoolBatchLayer(self, index) for index in range(pool.layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and the mask are given explicitly, per row


class PoolBatchLayer(CacheLayerMixin):
    """Layer `index` of a `PoolBatch`: scatters the rows' new keys into their slots, gathers their rows."""

    is_compileable = True
    is_sliding = False

    def __init__(self, batch: PoolBatch, index: int):  # noqa: see StaticKVLayer
        self.batch, self.index = batch, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [rows, kv_heads, bucket, head_dim] -> each row's [kv_heads, width, head_dim] of its slot."""
        batch = self.batch
        where = (batch.slot_index[:, None], batch.write_index)  # [rows, 1], [rows, bucket]
        out = []
        for store, states in ((batch.pool.keys, key_states), (batch.pool.values, value_states)):
            layer = store[self.index]
            layer.transpose(1, 2).index_put_(where, states.transpose(1, 2))  # a view: writes the pool
            out.append(layer[:, :, :batch.width].index_select(0, batch.slot_index))
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.width, 0

    def get_max_length(self) -> int:
        return self.batch.pool.capacity
