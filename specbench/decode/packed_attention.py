"""Attention for a packed batch: many sessions' new tokens in one sequence, each attending only to its
own pool row.

Why: a padded batch forward runs every linear layer on rows x longest-row tokens; with ragged rows
(prompt lookup proposes 4 tokens for one client and none for the next; a prefill chunk of 256 next to
1-token steps) most of that is padding. Packed, the linears see exactly the sum of the rows' tokens;
only attention, a small share of the cost, is done per row. This module is the attention half,
registered with transformers' `AttentionInterface` (its documented extension point) under
`ATTENTION`; called without a `packing=` layout it is plain SDPA, so lone forwards are unchanged.

Layout (`Packing`): segment r is `lengths[r]` tokens starting at `starts[r]` of the packed sequence,
belonging to pool slot `slots[r]`, whose first `pasts[r]` positions are already cached; the cache
layer has written the segment's keys and values right after them. Short segments (at most `SHORT`
tokens: verifies) attend in one padded SDPA call over the batch's pool rows; each longer one (a
prefill chunk) attends alone over its own row, so a 256-token chunk does not pad every verify to 256.
Example: segments of 1, 5 and 200 tokens: the first two attend as a [3, heads, 5, width] batch (the
third row there has no queries), the third as [1, heads, 200, past + 200].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ATTENTION = "specbench_packed"
SHORT = 16  # tokens; a longer segment attends alone
FOLD = 16  # query tokens: up to this many, a GQA layer's attention on a CPU runs folded (`sdpa`)


def install(model) -> bool:
    """Make `model` (an SDPA model whose attention goes through transformers' interface) accept
    `packing=`; True if it does. Other models are left as they are (the caller pads instead)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation == ATTENTION:
        return True
    if model.config._attn_implementation != "sdpa" or not type(model)._can_set_attn_implementation():
        return False
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # lone forwards get SDPA's own masks
    model.set_attn_implementation(ATTENTION)
    return True


def _attention(module, query, key, value, attention_mask, packing: Optional["Packing"] = None, **kwargs):
    if packing is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    return packing.attend(module, query, key, value, **kwargs)


_FOLD_LACKS = ("softcap", "position_bias", "cache", "s_aux")  # options the fold leaves to transformers


def sdpa(module, query, key, value, mask, **kwargs):
    """Transformers' SDPA attention, except for a few queries (verifies, decoding) of a GQA layer on a CPU:
    there each key/value head's group of query heads attends as that head's rows (`folded`), one SDPA
    call over the cache as it lies. Why: for one query transformers takes SDPA's `enable_gqa` path, whose
    CPU kernel ran 6.5x slower than this at 1,500 cached tokens (646 against 100 us a layer, SmolLM2 bf16),
    and for several it copies every key and value head `groups` times first (`repeat_kv`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups, count = getattr(module, "num_key_value_groups", 1), query.shape[2]
    if (groups == 1 or query.device.type != "cpu" or count > FOLD or (mask is None and count > 1)
            or (mask is not None and mask.shape[1] != 1) or kwargs.get("dropout", 0.0)
            or any(kwargs.get(name) is not None for name in _FOLD_LACKS)):
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    batch, heads, _, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups * count, dim)  # rows: each query head's `count` tokens
    if mask is not None and count > 1:
        mask = _tiled(mask, groups)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask,
                                                           scale=kwargs.get("scaling"))
    return out.reshape(batch, heads, count, value.shape[-1]).transpose(1, 2).contiguous(), None


_LAST_TILED: tuple = (None, None, 0)  # (a mask, its tiling, groups): every layer of a forward passes the same mask


def _tiled(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """`mask` [batch, 1, tokens, keys] repeated for the `groups` query heads folded into each row block
    (the last one kept, read and replaced whole, so threads forwarding at once never mix theirs)."""
    global _LAST_TILED
    last = _LAST_TILED
    if last[0] is mask and last[2] == groups:
        return last[1]
    tiled = mask.repeat(1, 1, groups, 1)
    _LAST_TILED = (mask, tiled, groups)
    return tiled


@dataclass
class Packing:
    """Where each segment of a packed forward lives (see the module docstring), and the masks its
    attention uses, built once per forward and shared by every layer."""

    slots: list[int]
    pasts: list[int]
    lengths: list[int]
    masks: list[torch.Tensor]  # segment r: [lengths[r], pasts[r] + lengths[r]] additive

    def __post_init__(self):
        self.starts = [sum(self.lengths[:r]) for r in range(len(self.lengths))]
        self.short = [r for r, n in enumerate(self.lengths) if n <= SHORT]
        self.long = [r for r, n in enumerate(self.lengths) if n > SHORT]
        first = self.slots[0]
        self.consecutive = self.slots == list(range(first, first + len(self.slots)))
        self.slot_index = torch.tensor(self.slots, dtype=torch.long)
        self._device_state = None

    def _prepare(self, dtype, device) -> None:
        """The short segments' padded mask and token placement, once per forward."""
        rows, longest = len(self.slots), max((self.lengths[r] for r in self.short), default=0)
        self.short_width = max((self.pasts[r] + self.lengths[r] for r in self.short), default=1)
        minimum = torch.finfo(dtype).min
        mask = torch.full((rows, 1, max(longest, 1), self.short_width), minimum, dtype=dtype)
        mask[:, 0, :, 0] = 0.0  # a padding query sees one column: no NaN, and its output is dropped
        tokens, places = [], []
        for r in self.short:
            n, past = self.lengths[r], self.pasts[r]
            mask[r, 0, :n] = minimum
            mask[r, 0, :n, :past + n] = self.masks[r]
            tokens += range(self.starts[r], self.starts[r] + n)
            places += range(r * longest, r * longest + n)
        self.short_longest = longest
        self.short_mask = mask.to(device)
        self.short_tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        self.short_places = torch.tensor(places, dtype=torch.long, device=device)
        self.all_short = not self.long
        self.slot_index = self.slot_index.to(device)
        self.long_masks = {r: self.masks[r][None, None].to(device=device, dtype=dtype) for r in self.long}
        self._device_state = (dtype, device)

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs):
        """query [1, heads, tokens, head_dim] packed; key, value: the pool's whole layer
        [slots, kv_heads, capacity, head_dim]. Returns [1, tokens, heads, head_dim], as SDPA does."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self._device_state != (query.dtype, query.device):
            self._prepare(query.dtype, query.device)
        heads, head_dim = query.shape[1], query.shape[3]
        flat = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
        out = torch.empty_like(flat)
        if self.short:
            rows, longest = len(self.slots), self.short_longest
            picked = flat if self.all_short else flat.index_select(0, self.short_tokens)
            padded = flat.new_zeros(rows * longest, heads, head_dim).index_copy_(0, self.short_places, picked)
            padded = padded.view(rows, longest, heads, head_dim).transpose(1, 2)
            keys, values = self._rows(key, self.short_width), self._rows(value, self.short_width)
            attended, _ = sdpa(module, padded, keys, values, self.short_mask, **kwargs)
            attended = attended.reshape(rows * longest, heads, head_dim).index_select(0, self.short_places)
            if self.all_short:
                out = attended
            else:
                out.index_copy_(0, self.short_tokens, attended)
        for r in self.long:
            start, n, slot, end = self.starts[r], self.lengths[r], self.slots[r], self.pasts[r] + self.lengths[r]
            attended, _ = sdpa_attention_forward(module, query[:, :, start:start + n], key[slot:slot + 1, :, :end],
                                                 value[slot:slot + 1, :, :end], self.long_masks[r], **kwargs)
            out[start:start + n] = attended[0]
        return out.unsqueeze(0), None

    def _rows(self, layer: torch.Tensor, width: int) -> torch.Tensor:
        """The batch's pool rows, first `width` positions: a view when the slots are consecutive."""
        if self.consecutive:
            return layer[self.slots[0]:self.slots[0] + len(self.slots), :, :width]
        return layer[:, :, :width].index_select(0, self.slot_index)
