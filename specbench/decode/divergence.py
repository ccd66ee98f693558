"""Where a greedy output leaves target-only's, and whether the target nearly tied there.

In float32 speculative decoding reproduces target-only's greedy tokens exactly. In bf16, across batch shapes
or with quantized kernels, a verify of several tokens rounds differently from a one-token forward, so two
tokens the target rates almost equally can swap: that is rounding, not a loss; any other difference is a
bug. The check is teacher-forced: the target's own logits after the outputs' common prefix, one forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd
import torch

NEAR_TIE_SHARE = 0.02  # how close two logits may be, as a share of the logits' range there, to count as a tie


@dataclass(frozen=True)
class Divergence:
    """The first token where `got` leaves `expected`. `expected_token`/`got_token` is None where that output
    had already ended (then nothing was chosen differently and `near_tie` is None)."""

    position: int
    expected_token: Optional[int]
    got_token: Optional[int]
    expected_logit: Optional[float]
    got_logit: Optional[float]
    share_of_range: Optional[float]  # |expected_logit - got_logit| / (max - min logit) there
    near_tie: Optional[bool]


def first_difference(expected: Sequence[int], got: Sequence[int]) -> Optional[int]:
    """The first index where the two differ (an output that ended counts), None when they are equal."""
    for index, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return index
    return None if len(expected) == len(got) else min(len(expected), len(got))


def divergence(model, prompt_ids: Sequence[int], expected: Sequence[int], got: Sequence[int],
               tolerance: float = NEAR_TIE_SHARE) -> Optional[Divergence]:
    """None when `got` equals `expected`; else where it left it and how far apart the target's logits of the
    two tokens were there. `model`: the target's transformers model, in the dtype the outputs came from."""
    position = first_difference(expected, got)
    if position is None:
        return None
    chosen = [tokens[position] if position < len(tokens) else None for tokens in (expected, got)]
    if None in chosen:
        return Divergence(position, *chosen, None, None, None, None)
    device = next(model.parameters()).device
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids) + list(expected[:position])], device=device)
        logits = model(input_ids=ids).logits[0, -1].float()
    spread = float(logits.max() - logits.min()) or 1.0
    wanted, produced = (float(logits[token]) for token in chosen)
    share = abs(wanted - produced) / spread
    return Divergence(position, chosen[0], chosen[1], wanted, produced, share, share <= tolerance)


def difference_lines(found: pd.DataFrame, dtype: str) -> list[str]:
    """What `specbench.api.divergences` found, a line each: a near-tie of the target's logits (rounding) or a
    defect; with a `where` column (local, remote, ...) each line names it."""
    if found.empty:
        return ["every output is target-only's, token for token"]
    lines = [f"outputs that left target-only's ({dtype}), at their first differing token, teacher-forced on the "
             "target (in bf16 a verify of several tokens rounds differently from a one-token forward):"]
    for row in found.itertuples():
        where = f"{row.where} " if "where" in found.columns else ""
        head = f"  {where}{row.method}, prompt {row.prompt_index}, token {row.position}: "
        if row.near_tie is None:
            lines.append(head + "one output ended there (a stop, not a different token)")
            continue
        verdict = ("a near-tie of the target's logits: rounding, not a loss" if row.near_tie else
                   "NOT a near-tie: a defect, please report it with the records")
        lines.append(head + f"target-only chose {row.expected_text!r} (logit {row.expected_logit:.3f}), "
                     f"{row.method} {row.got_text!r} ({row.got_logit:.3f}), {100 * row.share_of_range:.2f}% of the "
                     f"logits' range apart: {verdict}")
    return lines
