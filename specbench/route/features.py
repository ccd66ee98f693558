"""What a router knows of a prompt before any forward: its length, how much it repeats itself, how much of it
earlier outputs hold, its family.

All of it is set arithmetic over the prompt's token ids and lookups in the suffix cache of earlier outputs (a few
milliseconds for thousands of tokens), so routing costs nothing next to one forward of even a small model.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

NGRAMS = (2, 4, 8)
SEEN_N = 8  # the n-grams `seen_share` looks up: long enough that a hit is a quote, not a common phrase
NAMES = ("log_length",) + tuple(f"repeat_{n}" for n in NGRAMS) + ("tail_repeat", f"seen_{SEEN_N}")


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


def seen_share(ids: Sequence[int], memory, n: int = SEEN_N) -> float:
    """Share of the prompt's n-grams that earlier outputs hold (`memory`: a `SuffixCache` or `SuffixIndex` of
    them, anything with `match(context, length)`; None: nothing held). A later turn that quotes an earlier answer,
    or a file sent back for an edit, is what suffix decoding's cross-request cache copies, and nothing inside the
    prompt alone says so (a quoted answer occurs in the prompt once)."""
    ids = list(ids)
    if memory is None or len(ids) < n:
        return 0.0
    total = len(ids) - n + 1
    return sum(memory.match(ids[start:start + n], n) is not None for start in range(total)) / total


def seen_shares(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], n: int = SEEN_N) -> list[float]:
    """Each prompt's `seen_share` against the outputs of the prompts before it: what a fresh cache of earlier
    outputs holds when the prompts run in this order (a calibration run's)."""
    from specbench.decode.suffix_index import SuffixIndex

    memory, found = SuffixIndex(depth=n), []
    for number, (ids, output) in enumerate(zip(prompts, outputs)):
        found.append(seen_share(ids, memory, n))
        memory.extend(number, output)
    return found


def prompt_features(ids: Sequence[int], family: Optional[str] = None,
                    families: Sequence[str] = (), seen: float = 0.0) -> np.ndarray:
    """The feature vector: `NAMES` in order (`seen`: the prompt's `seen_share`), then one column per known family
    (1 for this prompt's)."""
    ids = list(ids)
    tail = ids[-64:]  # how repetitive the prompt is where decoding starts
    values = [math.log1p(len(ids))] + [repeat_share(ids, n) for n in NGRAMS] + [repeat_share(tail, 2), seen]
    values += [1.0 if family == known else 0.0 for known in families]
    return np.asarray(values, dtype=np.float64)


def feature_names(families: Sequence[str] = ()) -> list[str]:
    return list(NAMES) + [f"family={family}" for family in families]
