"""Train a router on calibration prompts: run every candidate over them, fit `router.fit_router`."""
from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd

from specbench.api import as_target, encode_prompts, run
from specbench.methods import get_method
from specbench.route.router import MARGIN, Candidate, Router, fit_router
from specbench.types import SpecbenchError


def candidates_from(specs: Sequence[str]) -> list[Candidate]:
    """"method" or "method:k" strings (e.g. "suffix:16", "prompt-lookup:4", "target-only") as candidates,
    each method checked against the method table first."""
    found = []
    for spec in specs:
        name, _, k = spec.partition(":")
        get_method(name)  # an unknown method is refused by name, with the list
        if k and not k.isdigit():
            raise SpecbenchError(f"candidate {spec!r}: K after ':' must be a whole number")
        found.append(Candidate(name, int(k) if k else 4))
    if not found:
        raise SpecbenchError("a router needs at least one candidate")
    return found


def train_router(target, prompts: Sequence, candidates: Sequence[Candidate], *, draft=None,
                 families: Optional[Sequence[str]] = None, objective: str = "speed", max_new_tokens: int = 64,
                 ridge: float = 1.0, margin: float | str = MARGIN, progress: bool = True,
                 **run_options) -> tuple[Router, pd.DataFrame]:
    """Run each candidate over `prompts` (text or ids), fit a router on their per-prompt records, and return
    it with the records. Candidates are checked before anything runs; `run_options` go to every `run`."""
    candidates = list(candidates)
    if not candidates:
        raise SpecbenchError("a router needs at least one candidate")
    for candidate in candidates:
        method = get_method(candidate.method)
        if method.kind != "none" and not method.lookup and draft is None and not method.on_worker:
            raise SpecbenchError(f"candidate {candidate.label} drafts with a model: pass draft=...")
    if not prompts:
        raise SpecbenchError("a router needs calibration prompts: got none")
    target, _ = as_target(target, run_options.get("dtype", "float32"), run_options.get("fast"))
    ids = encode_prompts(prompts, run_options.pop("tokenizer", None) or target.tokenizer, run_options.pop("chat", True))
    frames = [run(target, ids, method=c.method, draft=draft, k=max(1, c.k), max_new_tokens=max_new_tokens,
                  progress=f"router calibration: {c.label}" if progress else False, **run_options)
              for c in candidates]
    records = pd.concat(frames, ignore_index=True)
    return fit_router(records, ids, candidates, families, objective, ridge, margin), records
