"""Rows of a shared KV store handed out to sessions: the bookkeeping both KV pools share.

Why one class: the dynamic pool (`kv_pool.KVPool`, eager and packed forwards) and the static pool
(`static_kv.StaticPool`, compiled and graph-captured forwards) each keep one tensor per layer with a
row (slot) per session, hand rows out and take them back the same way; only what growing means
differs (the dynamic pool also grows its positions with the longest session; the static pool's
positions are fixed, and growing it moves tensors that captured graphs read). `docs/architecture.md`
says why two stores remain.

Example: a pool of 2 slots hands out 0, then 1; when both are taken, `acquire` asks the subclass to
`_grow_slots` and hands out 2; a released slot 0 is handed out before any higher one.
"""
from __future__ import annotations

import heapq
import threading


class SlotPool:
    def __init__(self, slots: int = 0):
        self.slots = slots
        self._free = list(range(slots))
        self._lock = threading.RLock()  # a slot's release can run from the GC inside a growth

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def acquire(self) -> int:
        """The lowest free slot, growing the pool first when none is free."""
        with self._lock:
            if not self._free:
                self._grow_slots()
            return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        with self._lock:
            heapq.heappush(self._free, slot)

    def _added(self, slots: int) -> None:
        """The pool now has `slots` slots: the new ones are free."""
        for slot in range(self.slots, slots):
            heapq.heappush(self._free, slot)
        self.slots = slots

    def _grow_slots(self) -> None:
        raise NotImplementedError
