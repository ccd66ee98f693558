"""One KV store for every session of a target: a tensor per layer, [slots, heads, capacity, head_dim].

Why: with a cache per session, a batched verify copied every session's keys and values into one
padded batch cache and appended the new ones back (each append a full `torch.cat`): on SmolLM2 with
8 sessions that was a quarter of the round. Here each session owns a row (slot) of the pool; a step
writes only its new positions in place, rollback is a length change, and a batch whose sessions hold
consecutive slots attends over a view of the pool, nothing copied. Lone forwards see the same view,
row `slot`, positions `[0, length)`.

Layout of row s: its `length` cached positions, then whatever earlier steps left (finite, never
attended: a lone forward sees `[0, length)`, a batch masks it). The pool starts zeroed and small and
grows (slots or capacity) by doubling where that fits its byte limit, else by what is needed, keeping
what it holds; a slot is released when its cache is dropped. Its cost: every row is as long as the
longest session, so a few long sessions next to many short ones hold more memory than caches
sized per session would.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specbench.decode.slot_pool import SlotPool
from specbench.types import SpecbenchError

CAPACITY_STEP = 64  # positions; capacity grows to a multiple of it


class KVPool(SlotPool):
    """Keys and values of all sessions of one model; rows are handed out by `acquire` (`SlotPool`)."""

    def __init__(self, num_layers: int, slots: int = 1, capacity: int = CAPACITY_STEP,
                 max_bytes: Optional[int] = None):
        super().__init__(slots)
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers
        self.capacity = capacity
        self.max_bytes = max_bytes  # growing past it is refused (the worker's --max-kv-gib)

    def _grow_slots(self) -> None:
        self._grow(slots=(self.slots + 1, self.slots * 2))

    def reserve_positions(self, length: int) -> None:
        """Make room for `length` positions in every row (doubling, so appends stay amortised O(1))."""
        if length > self.capacity:
            needed = -(-length // CAPACITY_STEP) * CAPACITY_STEP
            with self._lock:
                self._grow(capacity=(needed, max(needed, 2 * self.capacity)))

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values, allocated (zeroed) on first use with `like`'s heads and dtype."""
        if self.keys[index] is None:
            shape = (self.slots, like.shape[1], self.capacity, like.shape[3])
            self._check_budget(self.slots, self.capacity, 2 * like.shape[1] * like.shape[3] * like.element_size())
            with torch.inference_mode():  # pool tensors are inference tensors: written only in this mode
                self.keys[index] = torch.zeros(shape, dtype=like.dtype, device=like.device)
                self.values[index] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.keys[index], self.values[index]

    @torch.inference_mode()
    def write(self, index: int, slots: Sequence[int], pasts: Sequence[int], key_states: torch.Tensor,
              value_states: torch.Tensor, lengths: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment r of `key_states`/`value_states` ([1, heads, sum(lengths), head_dim], packed: segment r
        is the `lengths[r]` positions after the earlier segments; one segment of all of them when
        `lengths` is None) into slot `slots[r]` at positions `pasts[r]`..; the pool grows first if
        needed. Returns layer `index`'s whole tensors."""
        lengths = [key_states.shape[-2]] if lengths is None else lengths
        self.reserve_positions(max(past + n for past, n in zip(pasts, lengths)))
        keys, values = self.layer(index, key_states)
        start = 0
        for slot, past, n in zip(slots, pasts, lengths):
            keys[slot, :, past:past + n] = key_states[0, :, start:start + n]
            values[slot, :, past:past + n] = value_states[0, :, start:start + n]
            start += n
        return keys, values

    def release_memory(self) -> int:
        """With no row in use, drop the tensors (the next use allocates them small again); returns the
        bytes dropped. A pool only grows while sessions are open: without this, a worker that once
        served 8 long sessions held their rows' memory after every session closed."""
        with self._lock:
            if self.in_use:
                return 0
            dropped = self.nbytes()
            self.keys, self.values = [None] * len(self.keys), [None] * len(self.values)
            self.capacity = CAPACITY_STEP
            return dropped

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def _per_position(self, new_layer_bytes: int = 0) -> int:
        return new_layer_bytes + sum(
            t.shape[1] * t.shape[3] * t.element_size() for t in self.keys + self.values if t is not None)

    def _fits(self, slots: int, capacity: int) -> bool:
        return not self.max_bytes or self._per_position() * slots * capacity <= self.max_bytes

    def _check_budget(self, slots: int, capacity: int, new_layer_bytes: int = 0) -> None:
        """Refuse, naming the numbers, a pool that would hold more than `max_bytes`."""
        per_position = self._per_position(new_layer_bytes)
        needed = per_position * slots * capacity
        if self.max_bytes and needed > self.max_bytes:
            raise SpecbenchError(
                f"KV pool: {slots} sessions x {capacity} positions x {per_position} bytes = {needed} bytes, over "
                f"the limit of {self.max_bytes} bytes (the worker's --max-kv-gib); the longest session sets the "
                f"positions of every row, so fewer or shorter sessions fit")

    @torch.inference_mode()
    def _grow(self, slots: Optional[tuple[int, int]] = None, capacity: Optional[tuple[int, int]] = None) -> None:
        """Grow to the (needed, preferred) slots or capacity: the preferred doubling where it fits
        `max_bytes`, else just what is needed. All-or-nothing: every new tensor is allocated before any
        replaces the old one, so running out of memory here leaves the pool (and its sessions) as it was."""
        new_slots, new_capacity = (slots or (self.slots,) * 2)[1], (capacity or (self.capacity,) * 2)[1]
        if not self._fits(new_slots, new_capacity):
            new_slots, new_capacity = (slots or (self.slots,))[0], (capacity or (self.capacity,))[0]
        self._check_budget(new_slots, new_capacity)
        grown = [[None if old is None else
                  torch.zeros((new_slots, old.shape[1], new_capacity, old.shape[3]), dtype=old.dtype, device=old.device)
                  for old in store] for store in (self.keys, self.values)]
        for store, news in zip((self.keys, self.values), grown):
            for index, (old, new) in enumerate(zip(store, news)):
                if old is not None:
                    new[:self.slots, :, :self.capacity] = old
                    store[index] = new
        self._added(new_slots)
        self.capacity = new_capacity


class _PoolLayer(CacheLayerMixin):
    """What both layer views of a pool share: a full-attention layer whose keys sit in `pool`'s
    layer `index`, `get_seq_length()` positions before the new ones."""

    is_sliding = False
    is_compileable = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.pool.layer(self.index, key_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class PooledLayer(_PoolLayer):
    """One layer of one session: a view of its pool row; `update` writes the new positions in place."""

    is_croppable = True

    def __init__(self, pool: KVPool, index: int, slot: int):  # noqa: the mixin's __init__ would set keys
        self.pool, self.index, self.slot, self.length = pool, index, slot, 0
        self.is_initialized = True

    @property
    def keys(self) -> Optional[torch.Tensor]:
        keys = self.pool.keys[self.index]
        return None if keys is None else keys[self.slot:self.slot + 1, :, :self.length]

    @property
    def values(self) -> Optional[torch.Tensor]:
        values = self.pool.values[self.index]
        return None if values is None else values[self.slot:self.slot + 1, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.pool.write(self.index, [self.slot], [self.length], key_states, value_states)
        self.length += key_states.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of tokens to drop, negative")
        self.length = max(0, self.length + tokens_to_remove)

    @torch.inference_mode()
    def keep_tail(self, first: int, tail: torch.Tensor) -> None:
        """Positions `tail` (ascending, all >= `first`) move to `first`, `first + 1`, ...; the row's
        positions before `first` stay where they are. Compacts an accepted tree path."""
        keys, values = self.pool.keys[self.index], self.pool.values[self.index]
        if keys is not None and len(tail):
            tail = tail.to(keys.device)
            keys[self.slot, :, first:first + len(tail)] = keys[self.slot].index_select(1, tail)
            values[self.slot, :, first:first + len(tail)] = values[self.slot].index_select(1, tail)
        self.length = first + len(tail)

    def reset(self) -> None:
        self.length = 0


class PooledCache(Cache):
    """A session's cache in a `KVPool`: a Hugging Face `Cache`, so the model runs on it unchanged."""

    def __init__(self, pool: KVPool):
        self.pool, self.slot = pool, pool.acquire()
        super().__init__(layers=[PooledLayer(pool, index, self.slot) for index in range(len(pool.keys))])
        weakref.finalize(self, pool.release, self.slot)

    def set_length(self, length: int) -> None:
        """Every layer holds `length` positions: after a batched forward wrote this row's new ones."""
        for layer in self.layers:
            layer.length = length

    def keep(self, positions: Sequence[int]) -> None:
        """Keep only `positions` (ascending), in place: what stays where it is is not copied."""
        first_moved = next((i for i, p in enumerate(positions) if p != i), len(positions))
        tail = torch.as_tensor(list(positions[first_moved:]), dtype=torch.long)
        for layer in self.layers:
            layer.keep_tail(first_moved, tail)


def pool_for(model) -> Optional[KVPool]:
    """A pool for `model` when every layer of its default cache is a plain growing one (no sliding
    window, no linear attention), else None: those models keep Hugging Face's own caches."""
    from specbench.decode.kv import plain_layers

    if not plain_layers(model.config):
        return None
    return KVPool(model.config.get_text_config().num_hidden_layers)


class PackedLayer(_PoolLayer):
    """One layer of a packed forward over pool rows (`decode/packed_attention.py`): segment r's new
    positions are written after slot `slots[r]`'s own `pasts[r]` cached ones, and the pool's whole
    layer is returned, for the packed attention to read each segment's row from."""

    def __init__(self, pool: KVPool, index: int, slots: Sequence[int], pasts: Sequence[int],  # noqa: see PooledLayer
                 lengths: Sequence[int]):
        self.pool, self.index = pool, index
        self.slots, self.pasts, self.lengths = list(slots), list(pasts), list(lengths)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.pool.write(self.index, self.slots, self.pasts, key_states, value_states, self.lengths)

    def get_seq_length(self) -> int:
        return max(self.pasts)


def packed_cache(pool: KVPool, slots: Sequence[int], pasts: Sequence[int], lengths: Sequence[int]) -> Cache:
    """The cache a packed forward over these pool rows runs on (see `PackedLayer`)."""
    return Cache(layers=[PackedLayer(pool, index, slots, pasts, lengths) for index in range(len(pool.keys))])
