"""A per-prompt router (SpecDecode's idea): pick the method and K each prompt should get.

Trained on per-prompt records of every candidate run over calibration prompts: per candidate, a ridge
regression from the prompt's features (`route/features.py`, including how much of the prompt earlier outputs
hold: `seen`, given per prompt as it ran) to its tokens per step and draft tokens per
step (acceptance), and a step cost fitted on the same records: the target's forward (fixed + per verified
token, shared by all candidates) plus the candidate's drafting seconds per step, itself a ridge regression on
the features where records time drafting (`draft_s`), else a cost per drafted token. Per step, not per drafted
token: a hybrid (`suffix-eagle`) drafts many cheap suffix tokens on one prompt and few head tokens on another.
The predicted tokens/s of a candidate on a prompt is tokens per step over the cost of such a step, so the
router optimises speed, or the cost objective `verify_tokens` (target tokens verified per output token:
what a per-token verify service bills), not acceptance alone. Each choice keeps its reason: every candidate's
predicted figures.

A prompt leaves the default (the candidate best over all calibration prompts, measured) only for a candidate
predicted better by more than `margin`: per-candidate fits from a few dozen prompts differ by more than
candidates that draft alike do (benchmarks/results/2026-11-27-workload-hybrid.md). `margin="learn"` picks it
by cross-validation on the calibration prompts: each fold's router routes prompts it never saw, and the margin
whose choices were fastest as measured wins (the widest of equals; `inf`: always the default), since how far
per-prompt predictions can be trusted depends on the candidates and on how many prompts calibrate them. It is
the default wherever there are prompts enough to cross-validate (benchmarks/results/2026-11-27-workload-learned-
margin.md: learned, `auto` kept pace with the best fixed method; at a fixed 5% it ran 0.92-0.95x it).

Where prompts carry a family, the default can be the family's own: the candidate best over that family's
calibration prompts, measured (`by_family`). A few prompts of a family say which drafter pays there (a
translation prompt repeats nothing a suffix index could not find, a code edit resends a file) more reliably than a
ridge fit over every family does; cross-validation decides whether they do, beside the margin.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from specbench.route.features import SEEN_N, feature_names, prompt_features
from specbench.types import SpecbenchError, machine_note, reply_length_note

OBJECTIVES = ("speed", "verify_tokens")
MARGIN = 0.05
LEARN = "learn"  # margin: chosen by cross-validation on the calibration prompts
MARGINS = (0.0, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, math.inf)  # what cross-validation chooses among
FOLDS = 5
BY_FAMILY = {"learn": None, "on": True, "off": False}  # `by_family` as a command line names it


@dataclass(frozen=True)
class Candidate:
    """A method at one K (a tree's node budget; suffix decoding's cap), with the run's draft or its own (`draft`:
    a model name, id or path, or a key of the `drafts=` given to calibration and `run`)."""

    method: str
    k: int = 4
    draft: Optional[str] = None

    @property
    def drafts(self) -> bool:
        from specbench.methods import get_method

        return get_method(self.method).kind != "none"

    @property
    def recorded(self) -> str:
        """Its records' `method`: "chain", or "chain@smollm2-135m" with a draft of its own."""
        return f"{self.method}@{self.draft}" if self.draft else self.method

    @property
    def spec(self) -> str:
        """How `run` is asked for it: "chain:4", "chain:4@smollm2-135m"."""
        return f"{self.method}:{self.k}" + (f"@{self.draft}" if self.draft else "")

    @property
    def label(self) -> str:
        return f"{self.recorded} k={self.k}" if self.drafts else self.method


@dataclass
class _Fit:
    tokens: np.ndarray  # ridge weights: features (+1) -> tokens emitted per step
    drafted: np.ndarray  # -> draft tokens (nodes) verified per step
    fixed_s: float  # a step's seconds: fixed_s + per_token_s * (1 + drafted) + drafting
    per_token_s: float
    draft_s: Optional[np.ndarray] = None  # -> drafting seconds per step, where records time drafting (draft_s)


@dataclass
class Router:
    candidates: list[Candidate]
    families: list[str] = field(default_factory=list)
    objective: str = "speed"
    mean: Optional[np.ndarray] = None
    scale: Optional[np.ndarray] = None
    fits: dict[str, _Fit] = field(default_factory=dict)
    default: Optional[str] = None  # the label of the candidate best over all calibration prompts
    margin: float = 0.0  # how much better (relative) another candidate must be predicted to replace it
    margins: dict = field(default_factory=dict)  # a learned margin's reason: {margin: cross-validated score}
    family_defaults: dict = field(default_factory=dict)  # {family: label of its best candidate, measured}
    by_family: bool = False  # a prompt of a known family starts from its family's default
    family_margins: dict = field(default_factory=dict)  # as `margins`, with family defaults
    names: list = field(default_factory=list)  # the features it was fitted on ([]: every one of `feature_names`)
    reply_tokens: Optional[int] = None  # calibration's max_new_tokens (None: not recorded, a file saved before)
    machine: Optional[str] = None  # what calibration ran on (`hardware.machine_of`; None: a file saved before)

    def predict(self, ids: Sequence[int], family: Optional[str] = None, seen: float = 0.0) -> pd.DataFrame:
        """Each candidate's predicted tokens per step, draft tokens per step, step seconds, tokens/s and
        verified tokens per output token on this prompt (`seen`: its `features.seen_share`, against the cache of
        earlier outputs its suffix candidates draft from)."""
        if not self.fits:
            raise SpecbenchError("this router is not trained: use train_router(...) or Router.load(path)")
        x = np.append((self.features(ids, family, seen) - self.mean) / self.scale, 1.0)
        rows = []
        for candidate in self.candidates:
            fit = self.fits[candidate.label]
            tokens = max(1.0, float(x @ fit.tokens))
            drafted = 0.0 if not candidate.drafts else min(float(candidate.k), max(0.0, x @ fit.drafted))
            tokens = min(tokens, 1.0 + drafted)  # a step emits at most what it verified
            drafting = 0.0 if fit.draft_s is None else max(0.0, float(x @ fit.draft_s))
            step_s = fit.fixed_s + fit.per_token_s * (1.0 + drafted) + drafting
            rows.append({"candidate": candidate.label, "method": candidate.method, "k": candidate.k,
                         "draft": candidate.draft,
                         "tokens_per_step": tokens, "drafted_per_step": drafted, "step_s": step_s,
                         "tokens_per_s": tokens / step_s, "verify_tokens": (1.0 + drafted) / tokens})
        return pd.DataFrame(rows)

    def choose(self, ids: Sequence[int], family: Optional[str] = None,
               seen: float = 0.0) -> tuple[Candidate, pd.DataFrame]:
        """The best candidate under the objective, and every candidate's predictions (the reason)."""
        table = self.predict(ids, family, seen)
        return self.candidates[_pick(table, self.objective, self.default_for(family), self.margin)], table

    def features(self, ids: Sequence[int], family: Optional[str] = None, seen: float = 0.0) -> np.ndarray:
        """The prompt's features this router was fitted on (a file saved before a feature existed lacks it)."""
        every = prompt_features(ids, family, self.families, seen)
        if not self.names:
            return every
        where = {name: i for i, name in enumerate(feature_names(self.families))}
        return every[[where[name] for name in self.names]]

    @property
    def reads_seen(self) -> bool:
        """Whether this router's choice depends on what earlier outputs hold (`seen_share`)."""
        return f"seen_{SEEN_N}" in (self.names or feature_names(self.families))

    @property
    def keeps_outputs(self) -> bool:
        """Whether a candidate drafts from a cache of earlier outputs: only then did calibration give the router a
        seen share (else 0), and only then is there a cache for a routed request's output to go into."""
        from specbench.methods import get_method

        return any(get_method(c.method).keeps_outputs for c in self.candidates)

    def length_note(self, max_new_tokens: int) -> Optional[str]:
        """Why this router's choices may not hold for replies of `max_new_tokens` (`reply_length_note`), or None."""
        return reply_length_note(self.reply_tokens, max_new_tokens, "this router was calibrated",
                                 f"calibrate at this length (`specbench route --max-new-tokens {max_new_tokens}`)")

    def machine_note(self, here: str) -> Optional[str]:
        """Why this router's choices may not hold on the machine `here` (`types.machine_note`), or None."""
        return machine_note(self.machine, here, "this router was calibrated",
                            "calibrate on this machine (`specbench route`)")

    def default_for(self, family: Optional[str] = None) -> Optional[str]:
        """The candidate a prompt keeps unless another is predicted better by the margin: its family's best
        where `by_family` and the family was calibrated, else the best over all calibration prompts."""
        return self.family_defaults.get(family, self.default) if self.by_family else self.default

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        body = {"candidates": [[c.method, c.k] + ([c.draft] if c.draft else []) for c in self.candidates],
                "families": self.families,
                "objective": self.objective, "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "default": self.default, "margin": _finite(self.margin),
                "margins": {str(_finite(m)): score for m, score in self.margins.items()},
                "family_defaults": self.family_defaults, "by_family": self.by_family,
                "family_margins": {str(_finite(m)): score for m, score in self.family_margins.items()},
                "features": self.names or feature_names(self.families), "reply_tokens": self.reply_tokens,
                "machine": self.machine,
                "fits": {label: {"tokens": fit.tokens.tolist(), "drafted": fit.drafted.tolist(),
                                 "fixed_s": fit.fixed_s, "per_token_s": fit.per_token_s,
                                 "draft_s": None if fit.draft_s is None else fit.draft_s.tolist()}
                         for label, fit in self.fits.items()}}
        path.write_text(json.dumps(body, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Router":
        try:
            body = json.loads(Path(path).read_text())
            return cls([Candidate(m, int(k), *draft) for m, k, *draft in body["candidates"]], list(body["families"]),
                       body["objective"], np.asarray(body["mean"]), np.asarray(body["scale"]),
                       {label: _Fit(np.asarray(f["tokens"]), np.asarray(f["drafted"]), f["fixed_s"], f["per_token_s"],
                                    None if f.get("draft_s") is None else np.asarray(f["draft_s"]))
                        for label, f in body["fits"].items()}, body.get("default"), float(body.get("margin", 0.0)),
                       {float(m): float(score) for m, score in body.get("margins", {}).items()},
                       dict(body.get("family_defaults", {})), bool(body.get("by_family", False)),
                       {float(m): float(score) for m, score in body.get("family_margins", {}).items()},
                       _known_features(body.get("features"), list(body["families"])),
                       None if body.get("reply_tokens") is None else int(body["reply_tokens"]),
                       body.get("machine") if isinstance(body.get("machine"), str) else None)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SpecbenchError(f"{path}: not a router file ({type(error).__name__}: {error}); "
                                 f"train one with train_router(...) and save it") from None


def fit_router(records: pd.DataFrame, prompts: Sequence[Sequence[int]], candidates: Sequence[Candidate],
               families: Optional[Sequence[Optional[str]]] = None, objective: str = "speed",
               ridge: float = 1.0, margin: float | str | None = None, by_family: Optional[bool] = None,
               seen: Optional[Sequence[float]] = None) -> Router:
    """A router from `run` records of each candidate over `prompts` (rows labelled by method and k;
    `families[i]` is prompt i's family, when known). `margin`: a share, "learn" (cross-validated), or None:
    learned where there are at least 2 x `FOLDS` prompts, else `MARGIN`. `by_family`: start each prompt from its
    family's default; None: cross-validated with a learned margin, else off. `seen[i]`: prompt i's `seen_share`
    as it ran (`features.seen_shares`; None: 0, as where no candidate keeps outputs)."""
    if objective not in OBJECTIVES:
        raise SpecbenchError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if margin is None:
        margin = LEARN if len(prompts) >= 2 * FOLDS else MARGIN
    margin = parse_margin(margin)
    if not prompts:
        raise SpecbenchError("a router needs calibration prompts: got none")
    families = list(families) if families is not None else [None] * len(prompts)
    seen = list(seen) if seen is not None else [0.0] * len(prompts)
    if len(seen) != len(prompts):
        raise SpecbenchError(f"need one seen share per prompt, got {len(seen)} for {len(prompts)} prompts")
    if margin == LEARN:
        router = fit_router(records, prompts, candidates, families, objective, ridge, margin=0.0, seen=seen)
        tried = [bool(by_family)] if by_family is not None or not any(families) else [False, True]
        scores = {flag: learn_margin(records, prompts, candidates, families, objective, ridge, by_family=flag,
                                     seen=seen) for flag in tried}
        best = max(score for flag in tried for score in scores[flag].values())
        router.by_family = min(flag for flag in tried if max(scores[flag].values()) >= best)  # global at a tie
        router.margins, router.family_margins = scores.get(False, {}), scores.get(True, {})
        chosen = scores[router.by_family]
        router.margin = max(m for m, score in chosen.items() if score >= best)
        return router
    known = sorted({f for f in families if f})
    features = np.stack([prompt_features(ids, family, known, share)
                         for ids, family, share in zip(prompts, families, seen)])
    mean, scale = features.mean(axis=0), features.std(axis=0)
    scale[scale == 0] = 1.0
    x = np.hstack([(features - mean) / scale, np.ones((len(prompts), 1))])
    steps = {candidate: rows_of(records, candidate) for candidate in candidates}
    router = Router(list(candidates), known, objective, mean, scale, default=_best_overall(steps, objective),
                    margin=margin, by_family=bool(by_family))
    for family in known:
        own = [i for i, f in enumerate(families) if f == family]
        router.family_defaults[family] = _best_overall(
            {c: rows[rows["prompt_index"].isin(own)] for c, rows in steps.items()}, objective)
    timed = all("draft_s" in rows and rows["draft_s"].notna().all() for rows in steps.values())
    costs = _step_costs({c: rows.assign(step_s=rows["step_s"] - rows["draft_s"]) for c, rows in steps.items()},
                        own_draft_cost=False) if timed else _step_costs(steps)
    for candidate, rows in steps.items():
        per_prompt = rows.assign(draft_s=rows["draft_s"] if timed else 0.0).groupby("prompt_index").agg(
            tokens=("emitted", "mean"), drafted=("drafted", "mean"), draft_s=("draft_s", "mean"))
        missing = sorted(set(range(len(prompts))) - set(per_prompt.index))
        if missing:
            raise SpecbenchError(f"records of {candidate.label} lack prompts {missing[:5]}: run every candidate "
                                 f"over every calibration prompt")
        per_prompt = per_prompt.sort_index()
        fixed, per_token = costs[candidate.label]
        router.fits[candidate.label] = _Fit(_ridge(x, per_prompt["tokens"].to_numpy(), ridge),
                                            _ridge(x, per_prompt["drafted"].to_numpy(), ridge), fixed, per_token,
                                            _ridge(x, per_prompt["draft_s"].to_numpy(), ridge) if timed else None)
    return router


def parse_margin(value) -> float | str:
    """A margin as given on a command line or in code: a share >= 0, "inf", or "learn"."""
    if value == LEARN:
        return LEARN
    try:
        margin = float(value)
    except (TypeError, ValueError):
        raise SpecbenchError(f"margin must be a share >= 0, 'inf' or {LEARN!r}, got {value!r}") from None
    if not margin >= 0:
        raise SpecbenchError(f"margin must be >= 0, got {value}")
    return margin


def learn_margin(records: pd.DataFrame, prompts: Sequence[Sequence[int]], candidates: Sequence[Candidate],
                 families: Sequence[Optional[str]], objective: str = "speed", ridge: float = 1.0,
                 folds: int = FOLDS, by_family: bool = False,
                 seen: Optional[Sequence[float]] = None) -> dict[float, float]:
    """{margin: score} over `MARGINS`: `folds` routers, each fitted without every folds-th prompt, route those
    prompts; each prompt's chosen candidate is scored as its records measured it (tokens over step seconds
    for speed, tokens over verified tokens for the cost objective), summed over all prompts. With `by_family`
    each fold's router starts a prompt from the family default its own prompts measured (a family none of
    them holds: the overall default)."""
    count = len(prompts)
    seen = list(seen) if seen is not None else [0.0] * count
    if count < 2 * folds:
        raise SpecbenchError(f"a learned margin needs at least {2 * folds} calibration prompts, got {count}")
    steps = {c: rows_of(records, c) for c in candidates}
    measured = {c.label: rows.assign(verified=1 + rows["drafted"]).groupby("prompt_index")[
        ["emitted", "step_s", "verified"]].sum() for c, rows in steps.items()}
    cost = "step_s" if objective == "speed" else "verified"
    totals = {m: [0.0, 0.0] for m in MARGINS}
    for fold in range(folds):
        held = [i for i in range(count) if i % folds == fold]
        kept = [i for i in range(count) if i % folds != fold]
        renumber = {old: new for new, old in enumerate(kept)}
        subset = records[records["prompt_index"].isin(kept)].assign(
            prompt_index=lambda d: d["prompt_index"].map(renumber))
        router = fit_router(subset, [prompts[i] for i in kept], candidates, [families[i] for i in kept],
                            objective, ridge, margin=0.0, by_family=by_family, seen=[seen[i] for i in kept])
        for i in held:
            table = router.predict(prompts[i], families[i], seen[i])
            start = router.default_for(families[i])
            for m in MARGINS:
                chosen = measured[table.loc[_pick(table, objective, start, m), "candidate"]].loc[i]
                totals[m][0] += chosen["emitted"]
                totals[m][1] += chosen[cost]
    return {m: tokens / max(seconds, 1e-12) for m, (tokens, seconds) in totals.items()}


def _pick(table: pd.DataFrame, objective: str, default: Optional[str], margin: float) -> int:
    """The row of `table` (a router's predictions) to run: the best under the objective, unless it is predicted
    better than the default by no more than `margin`."""
    score = table["tokens_per_s"] if objective == "speed" else 1.0 / table["verify_tokens"]
    best = int(score.idxmax())
    if default is not None and margin > 0:
        kept = int(table.index[table["candidate"] == default][0])
        if score[best] <= score[kept] * (1.0 + margin):
            return kept
    return best


def predicted_speeds(table: pd.DataFrame) -> dict:
    """{candidate: predicted tokens/s} of a `Router.predict` table: the reason a routed request is told."""
    return {row.candidate: round(row.tokens_per_s, 3) for row in table.itertuples()}


def _known_features(saved: Optional[list], families: list) -> list:
    """The features a saved router was fitted on: as saved (a file from before `seen_8` lacks it), or, for a file
    that kept no list, those it could have had: every one but `seen_8`."""
    known = feature_names(families)
    if saved is not None:
        unknown = [name for name in saved if name not in known]
        if unknown:
            raise ValueError(f"features {unknown} are not this version's ({known})")
        return list(saved)
    return [name for name in known if name != f"seen_{SEEN_N}"]


def _finite(margin: float):
    return margin if math.isfinite(margin) else "inf"


def _best_overall(steps: dict[Candidate, pd.DataFrame], objective: str) -> str:
    """The candidate best over every calibration prompt together, as measured: tokens over seconds (speed),
    or fewest verified tokens per output token."""
    def score(rows: pd.DataFrame) -> float:
        if objective == "speed":
            return rows["emitted"].sum() / max(rows["step_s"].sum(), 1e-12)
        return rows["emitted"].sum() / (len(rows) + rows["drafted"].sum())
    return max(steps, key=lambda candidate: score(steps[candidate])).label


def rows_of(records: pd.DataFrame, candidate: Candidate) -> pd.DataFrame:
    """The records of one candidate: its method's rows (with its own draft's label), at its K where it drafts."""
    rows = records[records["method"] == candidate.recorded]
    if candidate.drafts:
        rows = rows[rows["k"] == candidate.k]
    if rows.empty:
        raise SpecbenchError(f"no records of candidate {candidate.label}; methods recorded: "
                             f"{sorted(set(records['method']))}")
    return rows


def _step_costs(steps: dict[Candidate, pd.DataFrame], own_draft_cost: bool = True) -> dict[str, tuple[float, float]]:
    """(fixed, per verified token) seconds per candidate, fitted jointly: one target's step is the same forward
    whoever drafted, so every candidate's steps share a fixed cost and a cost per verified token, and (with
    `own_draft_cost`, for records whose drafting is not timed apart) a model draft adds its own cost per drafted
    token. One fit over all steps is far better determined than one per candidate (a lookup's widths vary
    little). Where the joint fit comes out negative, each its own."""
    from specbench.methods import get_method

    drafting = [c for c in steps if c.drafts and not get_method(c.method).lookup] if own_draft_cost else []
    columns, seconds = [], []
    for candidate, rows in steps.items():
        drafted = rows["drafted"].to_numpy(dtype=float)
        own = [drafted if candidate is other else np.zeros_like(drafted) for other in drafting]
        columns.append(np.column_stack([np.ones_like(drafted), 1.0 + drafted, *own]))
        seconds.append(rows["step_s"].to_numpy(dtype=float))
    solution = np.linalg.lstsq(np.vstack(columns), np.concatenate(seconds), rcond=None)[0]
    fixed, per_token, extra = solution[0], solution[1], dict(zip(drafting, solution[2:]))
    if fixed < 0 or per_token < 0 or any(value + per_token < 0 for value in extra.values()):
        return {c.label: _step_cost(rows) for c, rows in steps.items()}
    # fixed + per_token * (1 + d) + extra * d  ==  (fixed - extra) + (per_token + extra) * (1 + d)
    return {c.label: (float(fixed - extra.get(c, 0.0)), float(per_token + extra.get(c, 0.0))) for c in steps}


def _step_cost(rows: pd.DataFrame) -> tuple[float, float]:
    """seconds per step = fixed + per_token * verified tokens, least squares over the steps (both >= 0)."""
    verified = 1.0 + rows["drafted"].to_numpy(dtype=float)
    seconds = rows["step_s"].to_numpy(dtype=float)
    if np.ptp(verified) == 0:
        return float(np.median(seconds)), 0.0
    per_token, fixed = np.polyfit(verified, seconds, 1)
    if per_token < 0 or fixed < 0:  # noise swamped the width's cost: a flat step
        return float(np.median(seconds)), 0.0
    return float(fixed), float(per_token)


def _ridge(x: np.ndarray, y: np.ndarray, strength: float) -> np.ndarray:
    penalty = strength * np.eye(x.shape[1])
    penalty[-1, -1] = 0.0  # the intercept is not shrunk
    return np.linalg.solve(x.T @ x + penalty, x.T @ y)
