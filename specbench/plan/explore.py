"""Operating-point grids and their predictions as DataFrames: what the Pareto views and the CLI plot.

Why a module of its own: notebooks, the `pareto` command and the benchmark all ask the same
question ("every method x size x place x RTT for this pair, priced") and must get the same table.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import pandas as pd

from specbench.methods import kind_method
from specbench.models.spec import acceptance_label
from specbench.plan.library import NOISY_SPREAD
from specbench.plan.costs import Power, Prices, StepCost
from specbench.plan.objectives import get_objective
from specbench.plan.predict import (AcceptanceReference, LatencyProfile, OperatingPoint, break_even_acceptance,
                                    choose, pareto_front, predict, priced)
from specbench.types import SpecbenchError



def operating_points(reference: Optional[AcceptanceReference], chain_ks: Sequence[int] = (1, 2, 3, 4, 5, 6, 8),
                     rtts_ms: Sequence[float] = (0.0,), remote: bool = False, local: bool = True,
                     rule: str = "greedy", clients: Sequence[int] = (1,),
                     worker_side: bool = True) -> list[OperatingPoint]:
    """Target-only plus every chain K the reference covers, every tree budget it measured and suffix decoding's
    hybrid with its draft at each budget recorded (`hybrid_steps`),
    at each place (local; remote at each RTT); with several client counts, each remote point again
    per count (clients share a remote worker, never a local target). A draft head's remote points come
    in both placements: on the client (its feature rows priced per committed position) and, with
    `worker_side`, on the worker (`eagle-server`: tokens only, no round trip per step)."""
    places = ([("local", 0.0)] if local else []) + ([("remote", float(r)) for r in rtts_ms] if remote else [])
    if not places:
        raise SpecbenchError("choose local, remote or both")
    sizes: list[tuple[str, int]] = [("target-only", 0)]
    if reference is not None:
        # a draft head's chains and trees are its own methods (same kinds, priced alike)
        chain, tree = ("eagle", "eagle-tree") if reference.draft.startswith("eagle:") else ("chain", "tree")
        # a reference without a full chain step (prompt lookup that never matched K tokens) predicts no chain
        sizes += [(chain, k) for k in chain_ks if 1 <= k <= reference.max_chain and reference.has_chains]
        sizes += [(tree, b) for b in sorted({int(b) for b in (*reference.tree_accepts, *reference.tree_steps)})]
        sizes += [(reference.hybrid_method, b) for b in sorted(int(b) for b in reference.hybrid_steps)]
    points = [OperatingPoint(method, k, where, rtt, rule, n) for where, rtt in places for method, k in sizes
              for n in (clients if where == "remote" else (1,))]
    if reference is None or not reference.draft.startswith("eagle:"):
        return points
    rows = reference.feature_bytes
    served = {method: f"{method}-server" for method in ("eagle", "eagle-tree", "suffix-eagle", "suffix-eagle-tree")}
    heads = [replace(p, feature_bytes=rows) for p in points if p.where == "remote" and p.method in served]
    return ([p for p in points if p.where == "local" or p.method not in served] + heads
            + ([replace(p, method=served[p.method], feature_bytes=0) for p in heads] if worker_side else []))


def prediction_frame(target: LatencyProfile, draft: Optional[LatencyProfile],
                     reference: Optional[AcceptanceReference], points: Optional[Sequence[OperatingPoint]] = None,
                     prices: Prices = Prices(), power: Power = Power(), context: int = 256,
                     overhead_s: float = 0.0, bandwidth_mbps: float = 0.0,
                     cost: str = "total_cost") -> pd.DataFrame:
    """One predicted row per operating point, with `on_front` marking the latency-cost Pareto set."""
    check_pairing(target, draft, reference)
    points = points if points is not None else operating_points(reference)
    rows = predict(points, target, draft, reference, prices, power, context, overhead_s, bandwidth_mbps)
    column = cost_column(cost)
    front = {row["label"] for row in pareto_front(rows, cost=column)}
    frame = pd.DataFrame(rows)
    frame["on_front"] = frame["label"].isin(front)
    frame["target"] = target.model
    frame["draft"] = draft.model if draft else None
    frame["device"] = target.device
    return frame


def base_name(label: str) -> str:
    """A model label without its quantization or kernels: `smollm2-135m@8bit+onednn` -> `smollm2-135m`."""
    return acceptance_label(label).split("@", 1)[0]


def origin_label(profile: LatencyProfile) -> str:
    """Where a profile came from, as a picker shows it: `shipped`, `own, 2026-11-25 vm`, or "" for one
    made in this process and never saved (its origin is the caller's own code)."""
    if not profile.origin:
        return ""
    return "shipped" if profile.origin == "shipped" else f"own, {profile.sitting}".rstrip(", ")


def target_groups(combos: Sequence[tuple]) -> dict[str, list[tuple]]:
    """(target, draft, reference) combos by target family, device, dtype, forward, prompt set and origin: the
    drafts and quantizations one Pareto view compares. Key example: `smollm2-135m (cpu-2t-AMD-EPYC, float32,
    bench) · shipped`; a fast forward's profiles, and a user's own, make views of their own:
    `qwen2.5-coder-1.5b (NVIDIA-H200, bfloat16, fast-cudagraph, bench) · shipped`,
    `smollm2-135m (cpu-2t-AMD-EPYC, float32, bench) · own, 2026-11-25 vm`; a view with a profile taken
    on a busy machine says so (`· busy machine: spread 0.45`)."""
    chosen: dict[tuple, tuple] = {}
    for combo in combos:  # several references of one pair on one prompt set: the one with most steps
        target, draft, reference = combo
        pair = (target.model, target.device, target.dtype, target.forward, draft_name(draft, reference),
                reference.dataset, origin_label(target))
        if pair not in chosen or len(reference.chain_accepts) > len(chosen[pair][2].chain_accepts):
            chosen[pair] = combo
    groups: dict[tuple, list[tuple]] = {}
    for target, draft, reference in chosen.values():
        forward = "" if target.forward == "eager" else f", {target.forward}"
        view = f"{base_name(target.model)} ({target.device}, {target.dtype}{forward}, {reference.dataset})"
        groups.setdefault((view, origin_label(target)), []).append((target, draft, reference))
    titled = {}
    for (view, origin), combos in groups.items():
        noise = max((p.noise or 0.0 for combo in combos for p in combo[:2] if p is not None), default=0.0)
        busy = f" · busy machine: spread {noise:.2f}" if noise >= NOISY_SPREAD else ""
        titled[f"{view}{f' · {origin}' if origin else ''}{busy}"] = combos
    return titled


def variants_frame(combos: Sequence[tuple], points, prices: Prices = Prices(), power: Power = Power(),
                   context: int = 256, cost: str = "total_cost",
                   draft_budget_bytes: Optional[float] = None) -> pd.DataFrame:
    """Several drafts and quantizations of one target family in one predicted frame.

    `points(reference)` gives each combo's operating points. Labels name the models (`smollm2-135m@8bit:
    chain K=4 (local)`); target-only appears once per target variant. A draft whose weights plus a
    `context`-token cache exceed `draft_budget_bytes` is kept with `fits` False (shown, never silently
    dropped) and left out of the Pareto front; a profile recorded before memory was measured has
    `draft_memory_bytes` NaN and counts as fitting.
    """
    frames, alone = [], set()
    for target, draft, reference in combos:
        frame = prediction_frame(target, draft, reference, points(reference), prices, power, context, cost=cost)
        solo = frame["kind"] == "none"
        if target.model in alone:
            frame = frame[~solo].reset_index(drop=True)
            solo = frame["kind"] == "none"
        alone.add(target.model)
        frame["target"], frame["target_quantization"] = target.model, target.quantization
        name = draft_name(draft, reference)
        frame["draft"], frame["draft_quantization"] = name, draft_quantization(draft)
        frame["variant"] = [f"{target.model} alone" if s else f"{name} -> {target.model}" for s in solo]
        frame["label"] = [f"{target.model if s else name}: {label}" for s, label in zip(solo, frame["label"])]
        # a free draft (prompt lookup, suffix decoding) holds no weights on the draft device
        memory = 0.0 if draft is None else draft.memory_bytes(context) if draft.weight_bytes else float("nan")
        frame["draft_memory_bytes"] = [0.0 if s else memory for s in solo]
        frames.append(frame)
    if not frames:
        raise SpecbenchError("no draft/target combination selected: pick at least one target and one draft quantization")
    frame = pd.concat(frames, ignore_index=True)
    frame["fits"] = True if draft_budget_bytes is None else ~(frame["draft_memory_bytes"] > draft_budget_bytes)
    column = cost_column(cost)
    front = {row["label"] for row in pareto_front(frame[frame["fits"]].to_dict("records"), cost=column)}
    frame["on_front"] = frame["label"].isin(front)
    return frame


def check_pairing(target: LatencyProfile, draft: Optional[LatencyProfile],
                  reference: Optional[AcceptanceReference]) -> None:
    """Refuse profiles of other models (a quantization included) than the reference measured: acceptance
    of an 8-bit draft says nothing about its 4-bit twin."""
    if reference is None:
        return
    wanted = {"target": (reference.target, target.model), "draft": (reference.draft, draft.model if draft else None)}
    for role, (measured, profiled) in wanted.items():
        if profiled is not None and measured != acceptance_label(profiled):
            raise SpecbenchError(
                f"the reference measured {role} {measured!r} but the {role} profile is of {profiled!r}: pick the "
                f"profile of {measured!r} (its quantization included), or record a reference for {profiled!r} "
                f"with `specbench reference`")


def recommend(frame: pd.DataFrame, cs: float, cost: str = "total_cost") -> pd.Series:
    """The row that minimises AutoDraft's J at cost weight `cs` (0 = fastest, 1 = cheapest), among the rows
    that fit the draft's memory budget (`fits`, where the frame has it)."""
    chosen = choose(_candidates(frame), cs, cost=cost_column(cost))
    return frame[frame["label"] == chosen["label"]].iloc[0]


def _candidates(frame: pd.DataFrame) -> list[dict]:
    """Rows a recommendation may pick: over-budget points are shown, never picked."""
    return (frame[frame["fits"]] if "fits" in frame else frame).to_dict("records")


def cs_ranges(frame: pd.DataFrame, cost: str = "total_cost", step: float = 0.05) -> pd.DataFrame:
    """Which point is recommended over which span of the cost weight (cs from 0 to 1 in `step`s): one row
    per span. A single row means the weight changes nothing here (one point is fastest and cheapest)."""
    spans: list[dict] = []
    rows, column = _candidates(frame), cost_column(cost)
    for i in range(int(round(1 / step)) + 1):
        cs = min(1.0, i * step)
        label = choose(rows, cs, cost=column)["label"]
        if spans and spans[-1]["label"] == label:
            spans[-1]["cs_to"] = cs
        else:
            spans.append({"cs_from": cs, "cs_to": cs, "label": label})
    return pd.DataFrame(spans)


def cs_summary(spans: pd.DataFrame) -> str:
    """One line saying how the recommendation moves with cs, or that it does not."""
    if len(spans) == 1:
        return (f"the cost weight changes nothing in this view: {spans['label'].iloc[0]} is recommended at every cs "
                f"(it is both the fastest and the cheapest point that matters); try another cost, place or RTT")
    return "recommended by cs: " + "; ".join(f"{row.cs_from:g}-{row.cs_to:g}: {row.label}" for row in spans.itertuples())


def cost_column(objective: str) -> str:
    """The column an objective's values are in (`plan/objectives.py`)."""
    return get_objective(objective).column


def measured_step(records: pd.DataFrame, clients: float = 1, drafts_on_target: bool = False) -> StepCost:
    """A run's mean step from its records, as the cost model prices one: tokens emitted, drafting, verify, wire, loop
    and bytes; `clients` the rows sharing each verify; `drafts_on_target` as `OperatingPoint.drafts_on_target`."""
    return StepCost(float(records["emitted"].mean()), float(records["draft_s"].mean()),
                    float(records["verify_s"].mean()), float(records["network_s"].mean()), float(records["overhead_s"].mean()),
                    float(records["bytes_up"].mean()), float(records["bytes_down"].mean()), clients, drafts_on_target)


def measured_points(records: pd.DataFrame, prices: Prices = Prices(), power: Power = Power(),
                    where: str = "local", rtt_ms: float = 0.0, clients: int = 1) -> pd.DataFrame:
    """Measured runs (records from `specbench.api.run`) priced like predictions, one row per (method, k),
    labelled as the matching predicted operating point so the two overlay in one figure. `clients`: how
    many clients shared the target while these records ran (all of their records given: tokens/s is
    per client, the target's time split between the rows of each of its rounds, as a prediction at that load
    prices it: a round of 3 rows while 8 clients run costs each of its rows a third, not an eighth)."""
    rows = []
    for (method, k), group in records.groupby(["method", "k"], sort=False):
        shared = clients
        if clients > 1 and "batch_size" in group and group["verify_s"].sum() > 0:
            # the rows a round's seconds are split between, as the target's seconds per token see them
            rows_of = group["batch_size"].fillna(1).clip(lower=1)
            shared = float(group["verify_s"].sum() / (group["verify_s"] / rows_of).sum())
        kind = group["kind"].iloc[0]
        label = OperatingPoint(kind_method(kind), int(k), where, rtt_ms, clients=clients).label
        step = measured_step(group, shared, OperatingPoint(method, int(k), where, rtt_ms).drafts_on_target)
        if group["planned"].any():  # K varies per step; no fixed-K prediction to overlay
            label = f"{method} K<={int(k)} ({label.rsplit('(', 1)[1]}"
        # measured speed: emitted tokens over wall time of the steps (not 1 / mean step)
        tokens_per_s = group["emitted"].sum() / group["step_s"].sum()
        rows.append({"label": label, "method": method, "kind": kind, "k": int(k), "clients": clients,
                     "where": where, "rtt_ms": rtt_ms, **priced(step, prices, power), "tokens_per_s": tokens_per_s,
                     "aggregate_tokens_per_s": clients * tokens_per_s, "steps": len(group)})
    return pd.DataFrame(rows)


def matching_pairs(profiles: Sequence[LatencyProfile], references: Sequence[AcceptanceReference],
                   target: Optional[str] = None, mix_origins: bool = False,
                   free_drafts: bool = False) -> list[tuple]:
    """(target profile, draft profile or None, reference) for every reference whose target and draft were both
    profiled on one device: the combinations a Pareto view can predict. A target profile pairs only with
    a draft profile of the same origin (shipped with shipped; a user's own with own ones of the same
    sitting, date and host), since a pair timed on different days or machines states were never side
    by side; `mix_origins` lifts that (a view's title still names the target's origin). `free_drafts` adds
    prompt lookup's and suffix decoding's references with no draft profile (None: drafting costs nothing),
    beside the target profiles that already pair with a model draft on that prompt set (else every
    profile of the target), so they join the views a user compares them in."""
    pairs = _model_pairs(profiles, references, target, mix_origins)
    if free_drafts:
        from specbench.plan.reference import FREE_DRAFTS

        heads = {(id(t), reference.dataset) for t, _, reference in pairs}
        for reference in references:
            if reference.draft not in FREE_DRAFTS or (target and reference.target != target):
                continue
            targets = [p for p in profiles if acceptance_label(p.model) == reference.target]
            joined = [p for p in targets if (id(p), reference.dataset) in heads]
            pairs += [(p, None, reference) for p in joined or targets]
    return pairs


def draft_name(draft: Optional[LatencyProfile], reference: AcceptanceReference) -> str:
    """A combo's draft as views name it: the draft model, or the reference's drafting (`prompt-lookup`, `suffix`)."""
    return draft.model if draft is not None else reference.draft


def draft_quantization(draft: Optional[LatencyProfile]) -> str:
    """A combo's draft quantization; prompt lookup and suffix decoding (no draft model) count as "none"."""
    return draft.quantization if draft is not None else "none"


def _model_pairs(profiles, references, target, mix_origins) -> list[tuple]:
    pairs = []
    for reference in references:
        if target and reference.target != target:
            continue
        for target_profile in (p for p in profiles if acceptance_label(p.model) == reference.target):
            drafts = [p for p in profiles if acceptance_label(p.model) == reference.draft
                      and p.device == target_profile.device
                      and (mix_origins or origin_label(p) == origin_label(target_profile))]
            # the draft's kernels and forward (eager, fast) as the target's where profiled, else any
            same = [p for p in drafts if p.model.removeprefix(reference.draft) ==
                    target_profile.model.removeprefix(reference.target)]
            same_forward = [p for p in (same or drafts) if p.forward == target_profile.forward]
            if drafts:
                pairs.append((target_profile, (same_forward or same or drafts)[0], reference))
    return pairs


def cached_pairs(profiles: Sequence[LatencyProfile], references: Sequence[AcceptanceReference], target: str,
                 draft: Optional[str], dataset: Optional[str] = None, device: Optional[str] = None,
                 dtype: Optional[str] = None, prefer: Optional[str] = None) -> list[tuple]:
    """(target profile, draft profile or None, reference or None) for `draft` (a model label, prompt lookup,
    suffix, or None for target-only) drafting for the model labelled `target`, among these profiles and references:
    the nearest to the target's device first (`hardware.nearness` to `prefer`, this CPU unless named), then the
    widest batch grid (it prices a worker's load). What a step planner and a server's predictions are built from."""
    from specbench.hardware import device_name, nearness
    from specbench.plan.predict import FREE_DRAFTS

    profiles = [p for p in profiles if device in (None, p.device) and dtype in (None, p.dtype)]
    references = [r for r in references if dataset in (None, r.dataset) and r.target == acceptance_label(target)
                  and draft is not None and r.draft == acceptance_label(draft)]
    if draft is None:
        pairs = [(p, None, None) for p in profiles if p.model == target]
    elif draft in FREE_DRAFTS:  # prompt lookup, suffix decoding: no draft model to profile
        pairs = [(p, None, r) for r in references for p in profiles if p.model == target]
    else:
        pairs = [p for p in matching_pairs(profiles, references) if (p[0].model, p[1].model) == (target, draft)]
    here = prefer or device_name("cpu")
    return sorted(pairs, key=lambda pair: (nearness(pair[0].device, here), -len(pair[0].batches)))


def break_even_frame(target: LatencyProfile, draft: LatencyProfile, reference: Optional[AcceptanceReference] = None,
                     ks: Sequence[int] = (1, 2, 4, 6), rtts_ms: Sequence[float] = (0.0,),
                     context: int = 256) -> pd.DataFrame:
    """Where SD stops paying off: per chain K and RTT, the mean accepted drafts per step needed to
    match target-only, next to what the reference measured (`pays_off` when it clears the bar)."""
    rows = []
    for rtt in rtts_ms:
        for k in ks:
            needed = break_even_acceptance(target, draft, k, context, rtt_ms=rtt)
            row = {"k": k, "rtt_ms": float(rtt), "break_even_accepted": needed, "max_possible": float(k)}
            if reference is not None and k <= reference.max_chain:
                row["measured_accepted"] = reference.accepted("chain", k)
                row["pays_off"] = row["measured_accepted"] > needed
            rows.append(row)
    return pd.DataFrame(rows)


def pair_predictions(profiles: Sequence[LatencyProfile], references: Sequence[AcceptanceReference],
                     rtts_ms: Sequence[float] = (), target: Optional[str] = None, prices: Prices = Prices(),
                     power: Power = Power(), context: int = 256, cost: str = "total_cost",
                     draft_budget_bytes: Optional[float] = None, free_drafts: bool = False) -> list[dict]:
    """One predicted frame per cached target family (the `pareto` command's and the demo report's sections),
    every draft and quantization of it together: local, plus remote at each RTT (`free_drafts`: prompt
    lookup's and suffix decoding's references too)."""
    sections = []
    for title, combos in target_groups(matching_pairs(profiles, references, target=target,
                                                      free_drafts=free_drafts)).items():
        points = lambda reference: operating_points(reference, rtts_ms=rtts_ms, remote=bool(rtts_ms))
        drafts = ", ".join(sorted({draft_name(draft, reference) for _, draft, reference in combos}))
        sections.append({"title": f"{title}: drafts {drafts}", "target": combos[0][0],
                         "predicted": variants_frame(combos, points, prices, power, context, cost,
                                                     draft_budget_bytes)})
    if not sections:
        raise SpecbenchError("no reference with matching target and draft profiles on one device; "
                             "run `specbench profile` and `specbench reference` first")
    return sections


def concurrency_frame(target: LatencyProfile, draft: LatencyProfile, reference: AcceptanceReference,
                      clients: Sequence[int] = (1, 2, 4, 8), chain_ks: Sequence[int] = (2, 4),
                      rtt_ms: float = 0.0, context: int = 256, overhead_s: float = 0.0) -> pd.DataFrame:
    """SD's speedup over target-only per number of clients sharing a remote target, for chains and the
    reference's tree budgets: where batching many clients' verifies makes drafting stop paying."""
    rows = []
    for n in clients:
        points = [p for p in operating_points(reference, chain_ks, rtts_ms=(rtt_ms,), remote=True, local=False,
                                              clients=(n,))]
        frame = pd.DataFrame(predict(points, target, draft, reference, context=context, overhead_s=overhead_s))
        base = frame.loc[frame["kind"] == "none", "tokens_per_s"].iloc[0]
        for row in frame[frame["kind"] != "none"].itertuples():
            rows.append({"clients": n, "method": row.method, "k": row.k,
                         "series": f"{row.method} {'K' if row.kind == 'chain' else 'budget'}={row.k}",
                         "tokens_per_s": row.tokens_per_s, "aggregate_tokens_per_s": row.aggregate_tokens_per_s,
                         "target_only_tokens_per_s": base, "speedup": row.tokens_per_s / base})
    return pd.DataFrame(rows)
