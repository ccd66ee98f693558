"""What a router knows of a prompt before any forward: its length, how much it repeats itself, its family.

All of it is set arithmetic over the prompt's token ids (well under a millisecond for thousands of
tokens), so routing costs nothing next to one forward of even a small model.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

NGRAMS = (2, 4, 8)
NAMES = ("log_length",) + tuple(f"repeat_{n}" for n in NGRAMS) + ("tail_repeat",)


def repeat_share(ids: Sequence[int], n: int) -> float:
    """Share of the prompt's n-grams that already occurred earlier in it: what prompt lookup and a
    suffix index's own context can copy. 0 for a prompt shorter than n + 1 tokens."""
    seen, repeated, total = set(), 0, 0
    for start in range(len(ids) - n + 1):
        gram = tuple(ids[start:start + n])
        total += 1
        repeated += gram in seen
        seen.add(gram)
    return repeated / total if total else 0.0


def prompt_features(ids: Sequence[int], family: Optional[str] = None,
                    families: Sequence[str] = ()) -> np.ndarray:
    """The feature vector: `NAMES` in order, then one column per known family (1 for this prompt's)."""
    ids = list(ids)
    tail = ids[-64:]  # how repetitive the prompt is where decoding starts
    values = [math.log1p(len(ids))] + [repeat_share(ids, n) for n in NGRAMS] + [repeat_share(tail, 2)]
    values += [1.0 if family == known else 0.0 for known in families]
    return np.asarray(values, dtype=np.float64)


def feature_names(families: Sequence[str] = ()) -> list[str]:
    return list(NAMES) + [f"family={family}" for family in families]
