"""Verify many sessions' draft trees in one target forward: what a shared target does for its clients.

Why: on a 2-core CPU one forward of 8 sequences x 5 tokens costs ~2x one sequence's, so batching the
verifies of 8 clients verifies ~4x more tokens per second. Each session keeps its own KV. Where the
target keeps its sessions in a KV pool and its attention takes a packed layout (most models), the
rows' inputs are packed into one sequence, with no padding, and each row's keys and values are
written and read in its own pool row (`_forward_packed`, `decode/packed_attention.py`). A fast
target runs the rows padded to a fixed shape over its static pool (`_forward_fast`). Otherwise
(a model whose attention takes no packed layout, or a target without a pool) the sessions' caches are
copied, left-aligned and padded, into one batch cache; sliding-window models (their layers hold only
a window) verify their sessions one after another:

    row i: [its P_i cached positions | padding up to P = max P_i | its n_i new inputs | padding to N]

The 4D mask lets row i's inputs see its own P_i positions and, among the new inputs, what its tree
allows (the same mask a lone verify builds), never padding or another row. Positions are row i's
own (P_i + depth), so rotary embeddings match the lone forward; only the shapes of the matmuls differ,
which can change float rounding, never which keys a query attends to. After the forward each row's
new keys and values are appended to its own cache, the accepted path kept, exactly as a lone verify.
Example: sessions with 10 and 3 cached tokens verifying a 4-node chain and a 2-node tree: P = 10,
N = 5 (tail + 4), a [2, 1, 5, 15] mask; row 1 sees columns 0..2 and 10..12.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from specbench.decode.clock import device_time
from specbench.decode.kv import cached_length, keep_positions, tree_attention_mask
from specbench.decode.kv_pool import PooledCache, packed_cache
from specbench.decode.packed_attention import Packing
from specbench.decode.target import LocalTarget, PrefillJob, SessionState, check_tree
from specbench.sampling.verify import verify
from specbench.types import DraftTree, SamplingParams, Timing, Verdict


@dataclass(frozen=True)
class VerifyRequest:
    session: str
    tree: DraftTree
    sampling: SamplingParams
    seed: int


@dataclass
class _Row:
    index: int
    request: Optional[VerifyRequest]  # None: a prefill chunk riding along (nothing to verify)
    state: SessionState
    past: int  # cached positions of this session
    inputs: list[int]  # its tail + tree tokens
    mask: torch.Tensor  # [n, past + n] additive, as a lone verify builds it
    positions: list[int]
    job: Optional[PrefillJob] = None  # the prefill a chunk row feeds
    features: Optional[torch.Tensor] = None  # [inputs, layers x hidden], for a session a draft head reads


def verify_batch(target: LocalTarget, requests: Sequence[VerifyRequest],
                 prefills: Sequence[tuple[PrefillJob, int]] = ()) -> list[Union[Verdict, Exception]]:
    """One verdict (or the error that request alone caused) per request, in order. At most one
    request per session: a session's steps are sequential by nature. `prefills`: (job, tokens) whose
    next chunk of that many prompt tokens rides in the same forward (packed targets only: padded, a
    chunk would pad every verify row to its length); the job counts them as fed and finishes at its
    next `advance`."""
    if len({r.session for r in requests}) != len(requests):
        raise ValueError("verify_batch takes at most one request per session")
    if not target.packed and not target.plain:
        if any(job.remaining and tokens > 0 for job, tokens in prefills):
            raise ValueError("prefill chunks ride in a batch only on a packed target")
        return [_alone(target, request) for request in requests]
    results: list[Union[Verdict, Exception, None]] = [None] * len(requests)
    rows = []
    for index, request in enumerate(requests):
        try:
            rows.append(_prepare(target, index, request))
        except Exception as error:  # refused before any work: the session is untouched
            results[index] = error
    chunks = [_chunk_row(job, tokens) for job, tokens in prefills if job.remaining and tokens > 0]
    if rows or chunks:
        started = device_time(target.device)
        packed = target.packed and all(isinstance(row.state.cache, PooledCache) and row.state.cache.pool is target.pool
                                       for row in rows + chunks)
        if chunks and not packed:
            raise ValueError("prefill chunks ride in a batch only on a packed target")
        if packed:  # in slot order, so consecutive slots attend over a view of the pool
            rows = sorted(rows + chunks, key=lambda row: row.state.cache.slot)
        logits = (_forward_fast if target.fast is not None else _forward_packed if packed else _forward)(target, rows)
        forward_s = device_time(target.device) - started
        _take_features(target, rows, packed)
        choices = _greedy_choices(rows, logits)
        for row, judged in zip(rows, logits):
            if row.request is None:
                row.job.fed += len(row.inputs)
                if row.features is not None:
                    row.state.features += list(row.features.unbind(0))
            else:
                results[row.index] = _finish(target, row, judged, forward_s, started, choices.get(row.index))
    return results


def _alone(target: LocalTarget, request: VerifyRequest) -> Union[Verdict, Exception]:
    """A lone verify, for sessions a padded batch cannot hold: sliding-window layers keep only their
    window's positions."""
    try:
        return target.verify(request.session, request.tree, request.sampling, request.seed)
    except Exception as error:
        return error


def _prepare(target: LocalTarget, index: int, request: VerifyRequest) -> _Row:
    state = target.state(request.session)
    tree = request.tree
    check_tree(tree, target.vocab_size, request.sampling)
    target.check_context(len(state.committed) + len(tree) + 1)
    past, num_prefix = cached_length(state.cache), len(state.tail)
    depths = tree.depths()
    positions = list(range(past, past + num_prefix)) + [past + num_prefix - 1 + d for d in depths]
    mask = tree_attention_mask(tree.parents, num_prefix, past, target.dtype, "cpu")[0, 0]
    return _Row(index, request, state, past, state.tail + list(tree.tokens), mask, positions)


def _chunk_row(job: PrefillJob, tokens: int) -> _Row:
    """A prefill's next chunk as a batch row: causal over its own cached positions and itself."""
    past, chunk = job.fed, job.next_chunk(tokens)
    mask = torch.zeros(len(chunk), past + len(chunk), dtype=job.target.dtype)
    mask[:, past:] = torch.full((len(chunk), len(chunk)), torch.finfo(mask.dtype).min).triu(1)
    return _Row(-1, None, job.state, past, chunk, mask, list(range(past, past + len(chunk))), job)


@torch.inference_mode()
def _forward(target: LocalTarget, rows: list[_Row]) -> list[torch.Tensor]:
    """Per row, the logits verification reads ([1 + tree nodes, vocab]), from one padded forward;
    each row's new K/V appended to its own cache."""
    from transformers import DynamicCache

    model, device = target.model, target.device
    batch, longest_past, longest_input = len(rows), max(r.past for r in rows), max(len(r.inputs) for r in rows)
    minimum = torch.finfo(target.dtype).min
    mask = torch.full((batch, 1, longest_input, longest_past + longest_input), minimum, dtype=target.dtype)
    for i, row in enumerate(rows):
        n = len(row.inputs)
        mask[i, 0, :n, : row.past] = row.mask[:, : row.past]
        mask[i, 0, :n, longest_past: longest_past + n] = row.mask[:, row.past:]
        mask[i, 0, n:, longest_past + n:] = 0.0  # padding queries see only padding: no NaN, no effect
    input_ids, position_ids = _padded_inputs(rows, longest_input)
    cache = DynamicCache(config=model.config)
    if longest_past:  # else every session is a one-token prompt with nothing cached yet
        for layer, batched in enumerate(cache.layers):
            batched.update(*_padded([row.state.cache.layers[layer] for row in rows], longest_past))
    output = model(input_ids=input_ids.to(device), past_key_values=cache, position_ids=position_ids.to(device),
                   attention_mask=mask.to(device), use_cache=True)
    for i, row in enumerate(rows):
        new = slice(longest_past, longest_past + len(row.inputs))
        for own, batched in zip(row.state.cache.layers, cache.layers):
            own.update(batched.keys[i:i + 1, :, new], batched.values[i:i + 1, :, new])
    return [output.logits[i, len(row.state.tail) - 1:len(row.inputs)] for i, row in enumerate(rows)]


@torch.inference_mode()
def _forward_packed(target: LocalTarget, rows: list[_Row]) -> list[torch.Tensor]:
    """`_forward` for sessions in the target's pool, packed: the rows' inputs are one sequence of
    sum(n_i) tokens (no padding), each row's new keys and values go straight after its own P_i cached
    ones in its pool row, and its attention reads only that row (`Packing`), under its own tree mask.
    The language-model head runs only on the positions verification reads (none for a prefill chunk)."""
    model, device = target.model, target.device
    slots, pasts = [row.state.cache.slot for row in rows], [row.past for row in rows]
    lengths = [len(row.inputs) for row in rows]
    packing = Packing(slots, pasts, lengths, [row.mask for row in rows])
    input_ids = torch.tensor([[t for row in rows for t in row.inputs]], device=device)
    position_ids = torch.tensor([[p for row in rows for p in row.positions]], device=device)
    judged = [range(start + len(row.state.tail) - 1, start + n) if row.request else range(0)
              for row, start, n in zip(rows, packing.starts, lengths)]
    keep = torch.tensor([i for span in judged for i in span], dtype=torch.long, device=device)
    output = model(input_ids=input_ids, past_key_values=packed_cache(target.pool, slots, pasts, lengths),
                   position_ids=position_ids, use_cache=True, logits_to_keep=keep, packing=packing)
    for row in rows:
        row.state.cache.set_length(row.past + len(row.inputs))
    return list(output.logits[0].split([len(span) for span in judged]))


def _forward_fast(target: LocalTarget, rows: list[_Row]) -> list[torch.Tensor]:
    """`_forward` for a fast target: one fixed-shape forward over the sessions' static pool rows
    (`FastForward.batch`), each row's new keys and values written in its own row."""
    logits = target.fast.batch([row.state.cache for row in rows], [row.inputs for row in rows],
                               [row.positions for row in rows], [row.mask for row in rows])
    return [judged[len(row.state.tail) - 1:] for judged, row in zip(logits, rows)]


def _take_features(target: LocalTarget, rows: list[_Row], packed: bool) -> None:
    """Each row's slice of the forward's features, for the sessions a draft head reads (packed: the rows
    are one sequence in order; padded: a batch row each, inputs first)."""
    if target.tap is None or all(row.state.features is None for row in rows):
        return
    joined, start = target.tap.joined(), 0
    for index, row in enumerate(rows):
        n = len(row.inputs)
        if row.state.features is not None:
            row.features = joined[0, start:start + n] if packed else joined[index, :n]
        start += n


def _padded_inputs(rows: list[_Row], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's input ids and positions, zero-padded on the right to `width`."""
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row.inputs)] = torch.tensor(row.inputs)
        position_ids[i, :len(row.inputs)] = torch.tensor(row.positions)
    return input_ids, position_ids


def _padded(layers: list, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of every row's cached keys and values in one [rows, heads, length, head_dim] pair,
    each row zero-padded on the right (a row with nothing cached is all padding)."""
    held = [layer.keys if getattr(layer, "keys", None) is not None and layer.keys.numel() else None
            for layer in layers]
    first = next(keys for keys in held if keys is not None)
    shape = (len(layers), first.shape[1], length, first.shape[3])
    keys = torch.zeros(shape, dtype=first.dtype, device=first.device)
    values = torch.zeros(shape, dtype=first.dtype, device=first.device)
    for i, (layer, own) in enumerate(zip(layers, held)):
        if own is not None:
            keys[i, :, :own.shape[-2]], values[i, :, :own.shape[-2]] = own[0], layer.values[0]
    return keys, values


def _greedy_choices(rows: list[_Row], logits: list[torch.Tensor]) -> dict[int, list[int]]:
    """The target's argmax per judged position of every greedy row, by request index, read from the
    device in one transfer (each `.tolist()` of a CUDA tensor waits for the device: one per row was
    one wait per row)."""
    greedy = [(row, judged) for row, judged in zip(rows, logits)
              if row.request is not None and row.request.sampling.effective_rule == "greedy"]
    if not greedy:
        return {}
    ids = torch.cat([judged.argmax(-1) for _, judged in greedy]).tolist()
    out, start = {}, 0
    for row, judged in greedy:
        out[row.index], start = ids[start:start + judged.shape[0]], start + judged.shape[0]
    return out


def _finish(target: LocalTarget, row: _Row, logits: torch.Tensor, forward_s: float,  # [1 + tree nodes, vocab]
            started: float, choices: Optional[list[int]] = None) -> Union[Verdict, Exception]:
    """Verification for one row, then its commit; a failure rolls back this session only."""
    request, state = row.request, row.state
    num_prefix = len(state.tail)
    try:
        generator = torch.Generator().manual_seed(request.seed)
        path, bonus = verify(request.tree, logits, request.sampling, generator, choices,  # stays on the device
                             position=len(state.committed))
    except Exception as error:
        keep_positions(state.cache, list(range(row.past)))
        return error
    keep_positions(state.cache, list(range(row.past + num_prefix)) + [row.past + num_prefix + i for i in path])
    if state.features is not None:
        state.features += list(row.features[list(range(num_prefix)) + [num_prefix + i for i in path]].unbind(0))
    state.committed += [request.tree.tokens[i] for i in path] + [bonus]
    state.tail = [bonus]
    state.check_invariant()
    timing = Timing(target_forward_s=forward_s, verify_s=device_time(target.device) - started)
    return Verdict(tuple(path), bonus, timing)
