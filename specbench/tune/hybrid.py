"""Suffix decoding with the best measured draft model or head, run beside the tune's best point before it chooses.

Why: wherever a draft model or a head was a candidate, the workload runs found the hybrid of the two (suffix decoding
where its counts and its record in the request vouch for a continuation, the draft elsewhere:
`suffix-tree-chain`, `suffix-eagle-tree`) the fastest fixed method: 1.58x target-only and 1.037x suffix decoding
alone for SmolLM2 with a trained head, 1.83x for the Qwen pair (docs/routing.md). Which drafter a step takes
depends on suffix decoding's counts and the request's record, which the planner's replay of one drafter cannot
price; so a tune measures it instead, as `duel.side_by_side` does two close points: target-only, the best measured
point and the hybrid, every held-back prompt through each in turn, and the choice is made on that run. The hybrid's
partner is the best measured one-client point of a draft model or head, its K (chain) or nodes (tree) the hybrid's
`other_k`; suffix decoding drafts up to `BUDGET` nodes a step, with the hand-over the workload runs chose (`KNOBS`).
Tried only where suffix decoding is a candidate. A tune for several clients through a worker measures the hybrid as it
measures a model draft's loaded point (`hybrid_at_load`): alone, its drafts recorded, then at the heaviest load
planned for, every client replaying them, that load's speed predicted from the lone run's own steps.
"""
from __future__ import annotations

import time
from typing import Optional

import pandas as pd

import specbench.tune.phases as phases
from specbench.methods import get_method
from specbench.plan.explore import cost_column
from specbench.plan.predict import choose, knob_values
from specbench.tune.duel import side_by_side
from specbench.tune.rows import measured_row
from specbench.tune.share import as_points, estimate_s
from specbench.tune.spec import SUFFIX, TuneSpec
from specbench.types import SpecbenchError

BUDGET = 16  # suffix decoding's nodes a step in the hybrid: the budget the workload runs measured it at
# the partner's method -> the hybrid: a model chain inside suffix decoding's tree; a head keeps its shape
GREEDY = {"chain": "suffix-tree-chain", "eagle": "suffix-eagle", "eagle-tree": "suffix-eagle-tree"}
CHAINS = {"chain": "suffix-chain", "eagle": "suffix-eagle"}  # where the rule cannot verify a tree hybrid
# the hybrid's own settings as the workload runs chose them: the draft takes a step where suffix decoding expects
# under half a token, and does not read a prompt over 4x the tokens left. Only fields that no other method reads: one
# interleaved run shares its suffix settings between its methods, and suffix decoding alone must run as measured.
# On a tune's 14 held-back prompts the SmolLM2 head's hybrid ran 1.020-1.060x itself at the defaults (two passes;
# with factor 2 and offset 1 too, 1.027-1.065x in three: benchmarks/results/2026-12-05-tune-hybrid.md)
KNOBS = {"hand_over": 0.5, "catch_up": 4.0}
HYBRID_ONLY = {"hand_over", "other_k", "catch_up", "trust", "bench_below"}  # SuffixSettings fields only hybrids read


def hybrid_suffix(other_k: int) -> dict:
    """Suffix decoding's settings for a hybrid whose draft drafts `other_k` tokens (chain) or nodes (tree)."""
    return {"other_k": int(other_k), **KNOBS}


def hybrid_method(method: str, rule: str) -> Optional[str]:
    """The hybrid of suffix decoding and a point run by `method`, one that `rule` can verify; None if none."""
    hybrid = GREEDY.get(method)
    if hybrid is not None and rule == "rejection" and not get_method(hybrid).rejection:
        hybrid = CHAINS.get(method)
    return hybrid


def hybrid_point(table: pd.DataFrame, spec: TuneSpec, candidates) -> Optional[dict]:
    """The hybrid of suffix decoding and the best measured one-client point (by J at cs) of a draft model or
    head in `table`, as a point row (`other_k` its partner's K); None without both in the tune."""
    by_name = {c.name: c for c in candidates}
    if SUFFIX not in by_name:
        return None
    rows = as_points(table)
    values = knob_values(rows, spec.cs, cost=cost_column(spec.objective))
    partners = [(values[i], row) for i, row in enumerate(rows)
                if int(row["clients"]) == 1 and by_name.get(row["candidate"]) is not None
                and by_name[row["candidate"]].method in ("chain", "eagle")
                and hybrid_method(row["method"], spec.verify_rule) is not None]
    if not partners:
        return None
    partner = min(partners, key=lambda pair: pair[0])[1]
    method, other_k = hybrid_method(partner["method"], spec.verify_rule), int(partner["k"])
    return {"label": f"{partner['candidate']}: {method} k={BUDGET} (suffix decoding, else {partner['method']} "
                     f"k={other_k})",
            "candidate": partner["candidate"], "method": method, "k": BUDGET, "other_k": other_k, "clients": 1,
            "tokens_per_s": partner["measured_tokens_per_s"], "partner": partner}  # speed: for the time estimate


def beside_hybrid(measured: pd.DataFrame, choice: pd.DataFrame, spec: TuneSpec, candidates, drafts: dict, store,
                  runner, held: list, rtt_ms: float, deadline: float, progress,
                  left_out: list) -> Optional[pd.DataFrame]:
    """Target-only, the best one-client point of `choice` (the measured points, or the duel's run), the
    `hybrid_point` of the `measured` points and its partner where that is not the best point, run side by side: that
    run's rows (target-only first, the hybrid with its `other_k`), or None where there is no hybrid to try or the
    budget has no room. One client: a tune for several runs `hybrid_at_load`."""
    hybrid = hybrid_point(measured, spec, candidates)
    if hybrid is None:
        return None
    rows = [row for row in as_points(choice) if int(row["clients"]) == 1]
    best = choose(rows, spec.cs, cost=cost_column(spec.objective))
    base = next(row for row in rows if row["method"] == "target-only")
    # the best point, the hybrid's partner where that is another point (the hybrid against its draft alone), the hybrid
    pair = [row for row in (best, hybrid["partner"]) if row["method"] != "target-only"]
    if len(pair) == 2 and pair[0]["method"] == pair[1]["method"]:
        pair = pair[:1]  # one run holds each method once: the partner is the best point (or another K of it)
    pair.append(hybrid)
    estimate = sum(estimate_s(row, len(held), spec) for row in [base, *pair])
    if time.monotonic() + estimate > deadline:
        left_out.append(f"{hybrid['label']}: not run beside {best['label']}, ~{estimate:.0f} s would pass the budget")
        return None
    try:
        found = side_by_side(store, runner, pair, base["label"], candidates, drafts, held, spec, rtt_ms, progress,
                             suffix=hybrid_suffix(hybrid["other_k"]))
    except SpecbenchError as error:  # a refusal of this extra run keeps the tune's own choice, and says why
        left_out.append(f"{hybrid['label']}: could not run ({error}); chosen without it")
        return None
    return found.assign(other_k=[hybrid["other_k"] if method == hybrid["method"] else None
                                 for method in found["method"]])


def hybrid_at_load(measured: pd.DataFrame, spec: TuneSpec, candidates, drafts: dict, store, runner, held: list,
                   rtt_ms: float, deadline: float, progress, left_out: list, price) -> Optional[pd.DataFrame]:
    """Through a worker, for several clients: the `hybrid_point` of the `measured` points run alone (its drafts
    recorded) and at the heaviest load planned for (each client replaying them, as `phases.measure` does a model
    draft), as rows of the tune's measured table with their `other_k`; None where there is no hybrid to try or the
    budget has no room. `price(records, row, clients)`: the loaded row's prediction, from the lone run's own steps
    played against the worker's rules; the lone row has none (nothing a tune records prices a hybrid's steps)."""
    hybrid = hybrid_point(measured, spec, candidates)
    if hybrid is None:
        return None
    heaviest = max(spec.clients)
    loaded = dict(hybrid, clients=heaviest, label=f"{hybrid['label']}, {heaviest} clients")
    estimate = estimate_s(hybrid, len(held), spec) + estimate_s(loaded, len(held), spec)
    if time.monotonic() + estimate > deadline:
        left_out.append(f"{hybrid['label']}: not run alone and at {heaviest} clients, ~{estimate:.0f} s would pass "
                        f"the budget")
        return None
    candidate = next(c for c in candidates if c.name == hybrid["candidate"])
    settings, column, rows = hybrid_suffix(hybrid["other_k"]), cost_column(spec.objective), []
    unpriced = {"tokens_per_s": float("nan"), "tokens_per_step": float("nan"), column: float("nan")}
    try:
        alone = phases.measure(store, runner, candidate, hybrid["method"], BUDGET, held, drafts[candidate.name], spec,
                               progress, suffix=settings)
        at_load = phases.measure(store, runner, candidate, hybrid["method"], BUDGET, held, drafts[candidate.name],
                                 spec, progress, clients=heaviest, suffix=settings)
    except SpecbenchError as error:  # a refusal of this extra run keeps the tune's own choice, and says why
        left_out.append(f"{hybrid['label']}: could not run ({error}); chosen without it")
        return None
    for row, records, predicted in ((hybrid, alone, unpriced), (loaded, at_load, price(alone, loaded, heaviest))):
        frame = pd.DataFrame([dict(predicted, label=row["label"])])
        rows.append(measured_row(candidate.name, hybrid["method"], BUDGET, records, frame, frame, spec, rtt_ms,
                                 label=row["label"], clients=int(row["clients"])))
    return pd.DataFrame(rows).assign(other_k=hybrid["other_k"])
