"""Train a router on calibration prompts: run every candidate over them (interleaved), fit `router.fit_router`."""
from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Optional, Sequence

import pandas as pd
from tqdm.auto import tqdm

from specbench.api import as_target, draft_resolver, encode_prompts, outputs, run
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.hardware import machine_of
from specbench.methods import get_method, parse_methods
from specbench.models.loading import as_loaded
from specbench.route.features import seen_shares
from specbench.route.router import Candidate, Router, fit_router, rows_of
from specbench.types import SpecbenchError

CHUNK = 8  # calibration prompts per round of candidates


def candidates_from(specs: Sequence[str]) -> list[Candidate]:
    """"method[:k][@draft]" strings (e.g. "suffix:16", "prompt-lookup:4", "target-only", "chain:4@smollm2-135m") as
    candidates, each method checked against the method table first (K defaults to 4)."""
    if not specs:
        raise SpecbenchError("a router needs at least one candidate")
    choices = parse_methods(specs, 4)
    if any(choice.name == "auto" for choice in choices):
        raise SpecbenchError("auto is the router itself, not a candidate: name the methods it chooses among")
    return [Candidate(choice.name, choice.k, choice.draft) for choice in choices]


def train_router(target, prompts: Sequence, candidates: Sequence[Candidate], *, draft=None, drafts=None,
                 families: Optional[Sequence[str]] = None, objective: str = "speed", max_new_tokens: int = 64,
                 ridge: float = 1.0, margin: float | str | None = None, by_family: Optional[bool] = None,
                 progress: bool = True, **run_options) -> tuple[Router, pd.DataFrame]:
    """Run each candidate over `prompts` (text or ids), fit a router on their per-prompt records, and return
    it with the records. Candidates are checked before anything runs; `run_options` go to every `run`."""
    candidates = list(candidates)
    if not candidates:
        raise SpecbenchError("a router needs at least one candidate")
    for candidate in candidates:
        if _needs_a_draft(get_method(candidate.method)) and draft is None and candidate.draft is None:
            raise SpecbenchError(f"candidate {candidate.label} drafts with a model: pass draft=...")
    if not prompts:
        raise SpecbenchError("a router needs calibration prompts: got none")
    target, _ = as_target(target, run_options.get("dtype", "float32"), run_options.get("fast"))
    ids = encode_prompts(prompts, run_options.pop("tokenizer", None) or target.tokenizer, run_options.pop("chat", True))
    records = calibrate(target, ids, candidates, draft=draft, drafts=drafts, max_new_tokens=max_new_tokens,
                        progress=progress, **run_options)
    seen = calibration_seen(records, ids, candidates, run_options.get("suffix"))
    router = fit_router(records, ids, candidates, families, objective, ridge, margin, by_family, seen)
    router.reply_tokens = max_new_tokens
    router.machine = machine_of(target)
    return router, records


def calibrate(target, ids: Sequence[Sequence[int]], candidates: Sequence[Candidate], *, draft=None, drafts=None,
              max_new_tokens: int = 64, chunk: int = CHUNK, suffix: Optional[SuffixSettings] = None,
              warmup: bool = True, progress: bool = True, **run_options) -> pd.DataFrame:
    """Every candidate over every prompt, interleaved: `chunk` prompts at a time, the candidates back to back
    (their order reversed every other chunk), so a machine that slows down part-way weighs on every candidate
    alike rather than on those measured last (a 26% slower verify for the last of seven, seen over a 20-minute
    calibration). Each suffix-decoding candidate keeps its own cache across the chunks: one shared cache would
    hand a later candidate the earlier ones' answers to the same prompts, and a cache kept from an earlier
    calibration its answers (process-wide caches are the 16 most recent). Rows' `prompt_index` index `ids`."""
    dtype = run_options.get("dtype", "float32")
    if any(drafts_with_a_model(c) and c.draft is None for c in candidates) and draft is not None:
        draft = as_loaded(draft, dtype)  # loaded once, not once a chunk
    draft_for = draft_resolver(draft, drafts, dtype)  # a candidate's own draft, loaded once too
    drafts = {c.draft: draft_for(c.draft, get_method(c.method)) for c in candidates if c.draft is not None}
    suffix = suffix or SuffixSettings()
    call = uuid.uuid4().hex[:8]  # this call's caches: a second calibration must not recall the first's answers
    starts = range(0, len(ids), max(1, chunk))
    bar = tqdm(total=len(starts) * len(candidates), desc="router calibration", unit="run", disable=not progress)
    frames = []
    for number, start in enumerate(starts):
        for c in candidates if number % 2 == 0 else candidates[::-1]:
            bar.set_postfix_str(c.label)
            records = run(target, ids[start:start + chunk], method=c.spec, draft=draft, drafts=drafts, k=max(1, c.k),
                          max_new_tokens=max_new_tokens, warmup=warmup and number == 0, progress=False,
                          suffix=replace(suffix, name=f"{suffix.name}router calibration {call} {c.label}"),
                          **run_options)
            frames.append(records.assign(prompt_index=records["prompt_index"] + start))
            bar.update()
    bar.close()
    return pd.concat(frames, ignore_index=True)


def calibration_seen(records: pd.DataFrame, ids: Sequence[Sequence[int]], candidates: Sequence[Candidate],
                     suffix: Optional[SuffixSettings] = None) -> Optional[list[float]]:
    """Each calibration prompt's `seen_share` as `calibrate` ran it: against the outputs of the prompts before it
    (each suffix candidate's cache starts empty and sees its own). None where no candidate keeps outputs or the
    cache is off: `run` then gives the router 0, and so must its fit."""
    keeping = [c for c in candidates if get_method(c.method).keeps_outputs]
    if not keeping or (suffix or SuffixSettings()).cache == "off":
        return None
    made = outputs(rows_of(records, keeping[0]))
    return seen_shares(ids, [made.get((keeping[0].recorded, i), []) for i in range(len(ids))])


def _needs_a_draft(method) -> bool:
    """A draft model or head, here: not target-only, not a lookup, not one the worker drafts for itself."""
    return method.kind != "none" and not method.lookup and not method.on_worker


def drafts_with_a_model(candidate: Candidate) -> bool:
    method = get_method(candidate.method)
    return _needs_a_draft(method) and not method.reads_features  # a head folder is not a model to load
