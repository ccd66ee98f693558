"""What a forward costs on this worker, fitted from its recent batches: seconds = fixed + per_token * tokens.

Why: the fixed part is what running a late row in a forward of its own costs on top of the row's
own tokens (reading the weights once more, launching once more), so it is the longest a batch may
wait for a client expected back (`--batch-wait-ms auto`): a longer wait idles the worker for more
than merging the row saves. Fitted on the worker's own batches, it needs no profile and follows
the hardware, the dtype and the load it is under. The same line, over rows instead of tokens, fits a
verify round's own work outside the forward (`Stats.host`), what predictions of a loaded worker add.
"""
from __future__ import annotations

from collections import deque
from typing import Optional


class ForwardCost:
    """A least-squares line through the last `window` batches' (size, seconds): size in tokens or rows."""

    def __init__(self, window: int = 64, least: int = 8, spread: float = 1.0):
        self.samples: deque = deque(maxlen=window)
        self.least = least  # batches needed before the fit is trusted
        self.spread = spread  # the sizes' variance needed to fit a slope (tokens: about a token apart)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples.append((float(tokens), seconds))

    def fit(self) -> Optional[tuple[float, float]]:
        """(fixed_s, per_token_s), or None while too few batches, or too alike in size, to tell them
        apart. The fixed part is clamped to [0, the cheapest batch seen]; the slope to >= 0."""
        if len(self.samples) < self.least:
            return None
        xs, ys = [x for x, _ in self.samples], [y for _, y in self.samples]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        if spread < self.spread * len(xs):  # sizes too alike: no slope to fit
            return None
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in self.samples) / spread)
        fixed = min(max(0.0, mean_y - slope * mean_x), min(ys))
        return fixed, slope

    def fixed_s(self) -> float:
        """The fitted fixed part; 0 (wait for no one) until it can be fitted."""
        fitted = self.fit()
        return fitted[0] if fitted else 0.0
