"""Telling a measurement of suffix decoding where its cache already held the request's own earlier answer.

Why: in the default "process" scope a suffix cache outlives a `run` call, so a second call over the same prompts
drafts each from its own output of the first (greedy: token for token) and measures a repeat request, not a first
one: on the Qwen2.5-Coder pair, 12 agentic prompts, the hybrid ran 4.80x target-only in a second call against 1.51x
in the first (benchmarks/results/2026-12-07-suffix-cache-repeats.md). The documentation said to pass
`cache="drafter"` when comparing runs; now the run says so too, where it matters.
"""
from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd

COLUMN = "cache_held_prompt"  # records: the drafter's cache held an output of this very prompt when it started


def held_prompt(drafter, prompt: Sequence[int]) -> Optional[bool]:
    """Whether `drafter`'s cache of earlier outputs holds one of `prompt` now; None for a drafter without one."""
    cache = getattr(drafter, "cache", None)
    holds = getattr(cache, "holds", None)
    return None if holds is None else bool(holds(prompt))


def repeat_note(records: pd.DataFrame) -> Optional[str]:
    """A sentence naming each method that drafted prompts from their own earlier outputs, and the remedy."""
    if COLUMN not in records or records.empty:
        return None
    marked = records[records[COLUMN].notna()]
    if marked.empty:
        return None
    found = []
    for method, rows in marked.groupby("method", sort=False):
        prompts = rows.groupby("prompt_index")[COLUMN].first()
        if prompts.any():
            found.append(f"{method} {int(prompts.sum())} of {len(prompts)}")
    if not found:
        return None
    return (f"suffix decoding's cache already held an output of the same prompt when these started ({', '.join(found)} "
            f"prompts; column {COLUMN}): an earlier run in this process, or a prompt given twice. Those requests drafted "
            f"from their own earlier answer, so their speed is a repeat request's, not a first one's; pass "
            f"suffix={{'cache': 'drafter'}} to measure from an empty cache.")
