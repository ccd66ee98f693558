"""SD's small forwards at fixed shapes: compiled on a CPU, graph-captured on CUDA.

Why: a draft step feeds 1 token and a verify 1..K+1 (or a tree's budget); Hugging Face's eager forward
pays Python and kernel-launch overhead per layer whatever the size, which on a GPU is most of the step
(measured on an H100: ~26 ms for a 1.5B forward of 1 or 64 tokens, ~1.2 ms of memory traffic). Fixed
shapes remove it: every step is padded to a bucket of `BUCKETS` tokens and attends over a width that is
a multiple of `static_kv.WIDTH_STEP`, so a few compiled graphs (or captured CUDA graphs) cover a whole
generation. A prompt runs in chunks padded to `PREFILL_BUCKETS` where steps replay (captured, static),
eagerly on the same cache where they compile. Each step of a Llama/Mistral/Qwen2/Qwen3 model is `lean_forward`'s
(fewer kernels than Hugging Face's forward, the same function).

Padding: a bucket's extra inputs are written into the cache past the step's real positions and see
only column 0; their logits are dropped and their keys lie beyond `length`, which no later mask
attends (the next step overwrites them). The real rows get exactly the mask an eager forward would
get, cut to the attended width, so outputs equal the eager forward up to float rounding of the shapes.

Batches (`FastForward.batch`, a worker shared by several clients): the sessions' caches are rows of one
`StaticPool` per model, so one forward scatters each row's new keys to its slot and gathers each row's
attended width by slot index, at a shape of rows x bucket x width (rows dynamic when compiled, padded
to a power of two when captured).

Backends: "compile" (`torch.compile`, CPU or GPU), "cudagraph" (one `torch.cuda.CUDAGraph` per batch size x
bucket x width, a lone step being a batch of one pool row: graphs replay at the pool's fixed addresses, for
every session, reading the rows by slot index), "compiled-graph" (CUDA: the
compiled step, its kernels fused, captured as "cudagraph" captures the plain one; a compile per shape), "static"
(the same fixed shapes run eagerly: what the others must reproduce, and a fallback where compiling is not possible).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from specbench.decode import lean_forward
from specbench.decode.kv import plain_layers
from specbench.decode.static_kv import PoolBatch, StaticKV, StaticPool, rounded, width_for
from specbench.types import FAST_BACKENDS, SpecbenchError

# Step sizes with their own graph (made on first use); longer inputs run eagerly, but for a prompt's chunks on
# the backends that replay (PREFILL_BUCKETS). Every size up to 8,
# since a CPU pays for padded tokens (a K=4 verify is 5 tokens); a GPU barely does.
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
# A prompt's chunks on the backends that replay fixed shapes without compiling them (compiling costs ~45 s per
# shape on a GPU): a GPU's eager forward of 48-256 tokens costs 30-50 ms of launches (1.5B on an H100), a replay
# ~5-9. Only the chunk's last row reaches the language-model head (the prefill reads one row of logits).
PREFILL_BUCKETS = (64, 128, 256)
PREFILL_BACKENDS = ("cudagraph", "static")
CAPTURED = ("cudagraph", "compiled-graph")  # backends that replay CUDA graphs


def check_fast_model(model) -> None:
    """Refuse, with the reason, models whose layers a static full-attention cache cannot stand in for."""
    if not plain_layers(model.config):
        raise SpecbenchError("fast forward: this model has layers other than full attention (a sliding window, "
                             "as in Gemma 3, or linear attention), which a static cache does not model; "
                             "run with fast=False")


class FastForward:
    """Forwards of one model over `StaticKV` caches; `__call__` mirrors an eager cached forward."""

    def __init__(self, model, capacity: int, backend: bool | str | None = None, lean: Optional[bool] = None):
        """`backend`: one of FAST_BACKENDS, or None / True / "auto" for the device's (cudagraph on CUDA).
        `lean`: steps through `lean_forward` where it supports the model (fewer kernels), else Hugging Face's
        forward; False always Hugging Face's (to compare them). None: lean unless the environment sets
        SPECBENCH_LEAN_STEP=0, the switch that bisects a failure on a device without editing code."""
        if lean is None:
            lean = os.environ.get("SPECBENCH_LEAN_STEP", "1") != "0"
        check_fast_model(model)
        self.model = model
        self.capacity = capacity
        device = model.get_input_embeddings().weight.device
        self.device, self.dtype = device, model.dtype
        if backend in (None, True, "auto"):
            backend = "cudagraph" if device.type == "cuda" else "compile"
        if backend not in FAST_BACKENDS:
            raise SpecbenchError(f"fast backend must be one of {FAST_BACKENDS}, got {backend!r}")
        if backend in CAPTURED and device.type != "cuda":
            raise SpecbenchError(f"the {backend} backend needs a CUDA model; this one is on {device}")
        self.backend = backend
        self.lean = lean_forward.LeanForward(model) if lean and lean_forward.supports(model) else None
        self._compiled = None
        if backend in ("compile", "compiled-graph"):
            import torch._dynamo

            # one graph per model x bucket x width: more than dynamo's default of 8 per function
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            self._compiled = torch.compile(self._step, dynamic=False)
        self.pool = StaticPool(model.config, capacity, self.dtype, device)  # every session's static cache
        self._graphs: dict[tuple, tuple] = {}  # captured: ("batch", size, bucket, width) -> (graph, buffers, out)
        self._graph_generation = 0  # the pool's generation the graphs were captured at
        self._scratch: Optional[int] = None  # the pool slot padding rows of a batch write to
        self.stats = {"bucketed": 0, "eager": 0, "batched": 0, "prefill": 0}
        self.shapes: set[tuple[int, int]] = set()  # (bucket, width) run: a graph each
        self.batch_shapes: set[tuple[int, int, int]] = set()  # (rows, bucket, width) of batched forwards

    @property
    def max_bytes(self) -> Optional[int]:
        """Every session's static cache together may hold at most this (the worker's --max-kv-gib)."""
        return self.pool.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: Optional[int]) -> None:
        self.pool.max_bytes = value

    def new_cache(self) -> StaticKV:
        """A session's static cache (a pool row), refused (naming the numbers) past `max_bytes`."""
        return StaticKV(self.pool)

    def forget(self, cache: StaticKV) -> None:
        """A closed session: give its slot back (graphs are per shape, shared by every session)."""
        cache.free()

    @torch.inference_mode()
    def __call__(self, cache: StaticKV, inputs: Sequence[int], position_ids: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits [len(inputs), vocab] (or the last `logits_to_keep` rows) for `inputs` appended to
        `cache`'s `length` positions; then `length` counts them. `position_ids` [1, n] and
        `attention_mask` [1, 1, n, length + n] (additive) as an eager forward takes them; None: causal."""
        n, past = len(inputs), cache.length
        if (n > BUCKETS[-1] and logits_to_keep == 1 and position_ids is None and attention_mask is None
                and self.backend in PREFILL_BACKENDS):
            return self._prefill(cache, inputs)
        bucket = next((b for b in BUCKETS if b >= n), None)
        if bucket is None or past + bucket > cache.capacity:
            logits = self._eager(cache, inputs, position_ids, attention_mask, logits_to_keep)
        else:
            logits = self._bucketed(cache, inputs, bucket, position_ids, attention_mask)
            logits = logits[n - logits_to_keep:n] if logits_to_keep else logits[:n]
        cache.length = past + n
        return logits

    def _eager(self, cache, inputs, position_ids, attention_mask, logits_to_keep):
        """An input longer than every bucket: one eager forward of exactly its tokens."""
        self.stats["eager"] += 1
        n, past = len(inputs), cache.length
        cache.prepare(torch.arange(past, past + n, device=self.device), past + n)
        mask = self._mask(attention_mask, n, n, past, cache.width).to(self.device)
        positions = self._positions(position_ids, n, n, past).to(self.device)
        input_ids = torch.tensor([list(inputs)], device=self.device)
        output = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                            past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        return output.logits[0]

    def _prefill(self, cache, inputs) -> torch.Tensor:
        """A causal run of prompt tokens in chunks of at most `PREFILL_BUCKETS[-1]`, each padded to a bucket and
        run as a one-row pool step whose head reads only the chunk's last real row (a captured graph's output
        is then one row, not bucket x vocab, for as long as the graph lives): the last row's logits [1, vocab].
        A chunk whose bucket would pass the cache's capacity runs eagerly."""
        size, logits = PREFILL_BUCKETS[-1], None
        for start in range(0, len(inputs), size):
            chunk = inputs[start:start + size]
            n, past = len(chunk), cache.length
            bucket = next(b for b in BUCKETS + PREFILL_BUCKETS if b >= n)
            if past + bucket > cache.capacity:
                logits = self._eager(cache, chunk, None, None, 1)
            else:
                logits = self._bucketed(cache, chunk, bucket, None, None, last_only=True)
            cache.length = past + n
        return logits

    def _bucketed(self, cache, inputs, bucket, position_ids, attention_mask, last_only: bool = False):
        """Logits [bucket, vocab] of `inputs` padded to `bucket`; `last_only` (a prefill chunk, never compiled):
        [1, vocab], the head reading only the last real row."""
        self.stats["prefill" if last_only else "bucketed"] += 1
        n, past = len(inputs), cache.length
        width = width_for(past + bucket, cache.capacity)
        self.shapes.add((bucket, width))
        input_ids = torch.zeros((1, bucket), dtype=torch.long)
        input_ids[0, :n] = torch.as_tensor(list(inputs), dtype=torch.long)
        positions = self._positions(position_ids, n, bucket, past)
        mask = self._mask(attention_mask, n, bucket, past, width)
        write_index = torch.arange(past, past + bucket)
        if self.backend != "compile":  # a batch of one pool row: captured once per shape for every session
            values = (input_ids, positions, mask, torch.tensor([cache.slot]), write_index.view(1, bucket))
            if last_only:
                return self._pool_step(1, bucket, width, values + (torch.tensor([n - 1]),), kind="prefill")[0]
            return self._pool_step(1, bucket, width, values)[0]
        cache.prepare(write_index.to(self.device), past + bucket)
        step = self._compiled or self._step
        return step(cache, input_ids.to(self.device), positions.to(self.device), mask.to(self.device))[0]

    @torch.inference_mode()
    def batch(self, caches: Sequence[StaticKV], inputs: Sequence[Sequence[int]],
              positions: Sequence[Sequence[int]], masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per row, logits [n_r, vocab] for `inputs[r]` appended to `caches[r]` at rotary `positions[r]`
        under `masks[r]` ([n_r, past_r + n_r] additive, as a lone verify builds it), from one fixed-shape
        forward; then each cache counts its inputs. The rows are padded to a bucket of tokens; compiled,
        the number of rows is a dynamic dimension (one graph per bucket x width); captured (and static),
        the batch is padded to a power of two (a few graphs) with rows of one scratch slot, held from the
        first padded batch on: they all write there, in any order, and attend its column 0; nothing reads
        either. Where no bucket holds the rows, or for one row, each runs alone, as `__call__` would."""
        pasts, longest = [cache.length for cache in caches], max(len(row) for row in inputs)
        bucket = next((b for b in BUCKETS if b >= longest), None)
        if (len(caches) == 1 or bucket is None or max(pasts) + bucket > self.pool.capacity
                or any(cache.pool is not self.pool for cache in caches)):
            return [self(cache, row, torch.tensor([where]), mask[None, None])
                    for cache, row, where, mask in zip(caches, inputs, positions, masks)]
        self.stats["batched"] += 1
        # captured graphs are per batch size: a few powers of two (static runs their shapes); a compiled
        # graph takes any (dynamic)
        size = len(caches) if self.backend == "compile" else 1 << (len(caches) - 1).bit_length()
        if size > len(caches) and self._scratch is None:  # the padding rows' one slot, held from now on
            self._scratch = self.pool.acquire()
        width = width_for(max(pasts) + bucket, self.pool.capacity)
        self.batch_shapes.add((size, bucket, width))
        input_ids = torch.zeros((size, bucket), dtype=torch.long)
        rotary = torch.arange(bucket).repeat(size, 1)  # padding rows: positions 0.., written at 0..
        write_index = rotary.clone()
        mask = torch.full((size, 1, bucket, width), torch.finfo(self.dtype).min, dtype=self.dtype)
        mask[:, 0, :, 0] = 0.0
        for r, (row, past) in enumerate(zip(inputs, pasts)):
            n = len(row)
            input_ids[r, :n] = torch.as_tensor(list(row), dtype=torch.long)
            rotary[r] = self._positions(torch.tensor(positions[r]), n, bucket, past)[0]
            mask[r] = self._mask(masks[r], n, bucket, past, width)[0]
            write_index[r] += past
        slot_index = torch.tensor([cache.slot for cache in caches] + [self._scratch] * (size - len(caches)))
        logits = self._pool_step(size, bucket, width, (input_ids, rotary, mask, slot_index, write_index))
        for cache, row, past in zip(caches, inputs, pasts):
            cache.length = past + len(row)
        return [logits[r, :len(row)] for r, row in enumerate(inputs)]

    def _pool_step(self, size: int, bucket: int, width: int, values: tuple, kind: str = "batch") -> torch.Tensor:
        """Logits [size, bucket, vocab] of one forward over pool rows; `values`: input ids, positions, mask,
        slot index, write index (on the host), and for a "prefill" the index of the one row the head reads
        (logits [size, 1, vocab]); replayed from a graph per kind and shape where captured."""
        if self.backend in CAPTURED:
            return self._replay((kind, size, bucket, width), values)
        values = [value.to(self.device) for value in values]
        if self.backend == "compile":  # one graph for every batch size: the rows dimension is symbolic
            for value in values:
                torch._dynamo.mark_dynamic(value, 0)
        input_ids, rotary, mask, slot_index, write_index, *keep = values
        step = self._compiled or self._step
        return step(PoolBatch(self.pool, slot_index, write_index, width), input_ids, rotary, mask, *keep)

    def _step(self, cache, input_ids, position_ids, mask, keep=0):
        """`keep`: 0 for every row's logits, or a tensor of the rows the head reads."""
        if self.lean is not None:
            return self.lean(cache, input_ids, position_ids, mask, keep)
        output = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                            past_key_values=cache, use_cache=True, logits_to_keep=keep)
        return output.logits

    def _replay(self, key: tuple, values: tuple) -> torch.Tensor:
        """CUDA: copy `values` (input ids, positions, mask, slot index, write index[, head rows]) into the buffers
        the graph `key` = (kind, size, bucket, width) was captured with, capturing it on first use over the
        pool rows its index buffers name, and replay it. Graphs captured before the pool grew (its tensors
        moved) are dropped. All share one memory pool (a graph per shape would otherwise hold its own
        activations), so a replay may overwrite what another left: the logits returned are a copy."""
        if self._graph_generation != self.pool.generation:
            self._graphs.clear()
            self._graph_generation = self.pool.generation
        if key not in self._graphs:
            buffers = tuple(value.to(self.device).clone() for value in values)
            cache = PoolBatch(self.pool, buffers[3], buffers[4], key[-1])  # reads its rows from the buffers
            step = self._compiled or self._step  # compiled-graph: fused kernels, then captured
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the capture (allocator, lazy inits; compiles)
                step(cache, *buffers[:3], *buffers[5:])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # a live graph's pool: a handle whose graphs were all dropped names a freed pool
            shared = next(iter(self._graphs.values()))[0].pool() if self._graphs else None
            with torch.cuda.graph(graph, pool=shared):
                out = step(cache, *buffers[:3], *buffers[5:])
            self._graphs[key] = (graph, buffers, out)
        graph, buffers, out = self._graphs[key]
        for buffer, value in zip(buffers, values):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return out.clone()

    def _positions(self, position_ids, n: int, bucket: int, past: int) -> torch.Tensor:
        """[1, bucket] positions (on the host): the given (or sequential) ones, then the padding's, counting on."""
        real = (torch.arange(past, past + n) if position_ids is None
                else position_ids.reshape(-1).to("cpu", torch.long))
        last = int(real[-1]) if n else past - 1
        padding = torch.arange(last + 1, last + 1 + bucket - n)
        return torch.cat([real, padding]).view(1, bucket)

    def _mask(self, attention_mask, n: int, bucket: int, past: int, width: int) -> torch.Tensor:
        """[1, 1, bucket, width] additive (on the host): the real rows' mask (causal when None), padding sees
        column 0."""
        minimum = torch.finfo(self.dtype).min
        mask = torch.full((bucket, width), minimum, dtype=self.dtype)
        if attention_mask is None:
            allowed = torch.ones(n, past + n, dtype=torch.bool)
            allowed[:, past:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            mask[:n, :past + n].masked_fill_(allowed, 0.0)
        else:
            given = attention_mask.reshape(n, past + n).to("cpu", self.dtype)
            mask[:n, :past + n] = given
        mask[n:, 0] = 0.0
        return mask.view(1, 1, bucket, width)


def chosen_backend(fast: bool | str | None, model) -> bool | str:
    """What `fast` asks of `model`: None (the default) turns the fast path on where it was measured to pay
    (an unquantized CUDA model whose layers a static cache models: 6-17x per forward and 4-5x a worker's
    tokens/s on an H100, README) and off elsewhere (on a CPU it gains 1.0-1.5x alone but loses at 8
    batched rows); False or "off" never; True, "auto" or a backend: on."""
    if fast is None:
        on_cuda = model.get_input_embeddings().weight.device.type == "cuda"
        quantized = getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False)
        return "cudagraph" if on_cuda and not quantized and plain_layers(model.config) else False
    return False if fast == "off" else fast


def fast_capacity(max_context: Optional[int], wanted: Optional[int]) -> int:
    """Positions each static cache holds: what the caller asked for, else the model's context capped
    at 4096 (a 1.5B model's fp32 cache is ~57 KB per position), in whole `WIDTH_STEP`s."""
    capacity = wanted or min(max_context or 4096, 4096)
    return rounded(capacity)
