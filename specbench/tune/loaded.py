"""A tune's points at several clients, priced by simulating the clients against the worker's batching.

Why: the predictor prices a loaded step as lock-step (every client drafts, then one batched verify).
Through a worker on a CPU, clients drift apart and queue behind each other's verifies; priced so, the
Qwen pair's loaded points were over-predicted by a median 31-78% (benchmarks/results/
2026-11-27-tune-qwen-worker.md). Here each held-back prompt's steps (replayed acceptance: `steps_at_k`
of the held-back reference; target-only: one token a step) are dealt to the clients as `phases.together`
deals prompts, each step's own time is the point's lone step priced by the cost model (drafting, loop,
wire), and `plan.queueing.simulate` plays them against the worker's rules, its forwards from the
calibrated profile's batch grid. After a point's one-client run is measured, its loaded points replay
that run's own steps instead (`from_records`). Trees keep the lock-step price (no per-step sequence).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import pandas as pd

from specbench.plan.costs import Power, Prices, StepCost
from specbench.plan.predict import HostCost, LatencyProfile, OperatingPoint, predict_step, priced
from specbench.plan.queueing import ClientPrompt, ClientStep, Simulated, WorkerRules, simulate


def deal(count: int, clients: int, index: int) -> list[int]:
    """The prompts client `index` of `clients` decodes, of `count`: index, index + clients, ..., wrapping round,
    so each decodes as many (batches stay full but for the last steps' tail)."""
    return [(index + clients * turn) % count for turn in range(math.ceil(count / clients))]


def worker_rules(profile: LatencyProfile, stats: Optional[dict]) -> WorkerRules:
    """The worker's rules as its `stats` show them: its round's own work, and (a worker started with its
    default `--batch-wait-ms auto`) its wait cap, the fixed cost of a forward fitted on its batches (before
    it has batches to fit: the same line through the profile's lone forwards), bounded by the 1-token
    forward; the forwards from `profile`'s batch grid."""
    stats = stats or {}
    lone = [(row[0], row[2]) for row in profile.rows_of(1) if row[1] == profile.rows[0][1]]
    fixed = stats.get("forward_fixed_s")
    if fixed is None and len({tokens for tokens, _ in lone}) > 1:
        fixed = _intercept(lone)
    one = min((seconds for tokens, seconds in lone if tokens == 1), default=float(fixed or 0.0))
    cap = min(max(float(fixed or 0.0), 0.0), one)
    return WorkerRules(profile.forward_s, HostCost.from_stats(stats), wait_cap_s=cap)


def _intercept(points: list) -> float:
    """The least-squares line's value at 0 tokens through (tokens, seconds) points."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx


def baseline_prompts(baseline: pd.DataFrame) -> dict[int, tuple[int, float, int]]:
    """Per held-back prompt, from the target-only run: (prompt tokens, prefill seconds, output tokens)."""
    out = {}
    for index, steps in baseline.groupby("prompt_index", sort=True):
        tokens = int(steps["prompt_tokens"].iloc[0]) if "prompt_tokens" in steps else 0
        prefill = float(steps["prefill_s"].iloc[0]) if "prefill_s" in steps else 0.0
        out[int(index)] = (tokens, prefill, int(steps["emitted"].sum()))
    return out


def reference_prompts(reference, k: int, lone: StepCost, prompts: dict) -> Optional[dict[int, ClientPrompt]]:
    """Each held-back prompt's chain steps at K from a replayed reference (`steps_at_k` with their prompts),
    each step's own time the point's lone one (drafting scaled by what it drafted); None without them."""
    steps, owners = reference.steps_at(k), reference.prompts_at(k)
    if not steps or not owners or len(owners) != len(steps):
        return None
    mean_drafted = sum(d for d, _ in steps) / len(steps) or 1.0
    by_prompt: dict[int, list] = {}
    for (drafted, accepted), owner in zip(steps, owners):
        by_prompt.setdefault(int(owner), []).append((drafted, accepted))
    out = {}
    for index, (tokens, prefill, _) in prompts.items():
        context, own = tokens, []
        for drafted, accepted in by_prompt.get(index, ()):
            think = lone.draft_s * drafted / mean_drafted + lone.overhead_s + lone.network_s
            own.append(ClientStep(think, 1 + drafted, accepted + 1, context))
            context += accepted + 1
        out[index] = ClientPrompt(tokens, prefill, tuple(own))
    return out


def single_token_prompts(lone: StepCost, prompts: dict) -> dict[int, ClientPrompt]:
    """Target-only: a step per output token."""
    return {index: ClientPrompt(tokens, prefill, tuple(ClientStep(lone.overhead_s + lone.network_s, 1, 1, tokens + i)
                                                        for i in range(length)))
            for index, (tokens, prefill, length) in prompts.items()}


def from_records(records: pd.DataFrame) -> dict[int, ClientPrompt]:
    """A one-client run's own steps per prompt: what each step drafted, committed and took on the client."""
    out = {}
    for index, steps in records.groupby("prompt_index", sort=True):
        tokens = int(steps["prompt_tokens"].iloc[0])
        context, own = tokens, []
        for step in steps.sort_values("step").itertuples():
            own.append(ClientStep(step.draft_s + step.overhead_s + step.network_s, 1 + int(step.drafted),
                                  int(step.emitted), context))
            context += int(step.emitted)
        out[int(index)] = ClientPrompt(tokens, float(steps["prefill_s"].iloc[0]), tuple(own))
    return out


def run_clients(prompts: dict[int, ClientPrompt], clients: int, rules: WorkerRules) -> Simulated:
    """`clients` clients decoding the prompts dealt to them at once."""
    order = sorted(prompts)
    return simulate([[prompts[order[i]] for i in deal(len(order), clients, c)] for c in range(clients)], rules)


def repriced(row: dict, lone: StepCost, simulated: Simulated, prices: Prices, power: Power) -> dict:
    """`row` with its speed and costs from the simulation: the step's wait (queue, a part-full round, a prefill
    riding in it) is the client's own time, and the target's time per token is a round's verify over the round's
    mean rows. Why without the prefills: a step's verify prices decoding, as a one-client point and a measured run
    price it (with them, 8 clients' cost per token was 33% over the measured on the Qwen pair, their speed 4%)."""
    steps = max(len(simulated.queue_s), 1)
    step_s = simulated.step_s / steps
    round_s = (simulated.busy_s - simulated.riding_s) / max(len(simulated.rows), 1)
    waited = max(step_s - lone.draft_s - lone.network_s - lone.overhead_s - round_s, 0.0)
    tokens_per_step = simulated.tokens / steps
    step = replace(lone, tokens_per_step=tokens_per_step, verify_s=round_s, overhead_s=lone.overhead_s + waited,
                   clients=max(simulated.mean_rows, 1.0))
    out = dict(row, **priced(step, prices, power), simulated=True)
    out["tokens_per_s"] = simulated.tokens_per_s
    out["aggregate_tokens_per_s"] = int(row["clients"]) * simulated.tokens_per_s
    return out


def replayed_load(records: pd.DataFrame, row: dict, clients: int, rules: WorkerRules, prices: Prices = Prices(),
                  power: Power = Power()) -> dict:
    """`row` priced at `clients` clients from a one-client run's own `records` alone: its steps replayed against the
    worker's rules, each step's drafting, loop and wire time the run's mean (`repriced`). For a point no reference
    prices (suffix decoding's hybrid: which drafter takes a step depends on the request's own record)."""
    from specbench.plan.explore import measured_step

    point = OperatingPoint(row["method"], int(row["k"]), row.get("where", "remote"))
    lone = measured_step(records, drafts_on_target=point.drafts_on_target)
    return repriced(dict(row, clients=clients), lone, run_clients(from_records(records), clients, rules), prices, power)


def loaded_frame(frame: pd.DataFrame, references: dict, profiles, baseline: pd.DataFrame, rules: WorkerRules,
                 context: int, overhead_s: float = 0.0, alone: Optional[dict] = None,
                 prices: Prices = Prices(), power: Power = Power()) -> pd.DataFrame:
    """`frame` (a tune's prediction) with every chain and target-only point above one client priced by
    simulation. `references`: each candidate's (held-back) reference; `profiles`: (target profile, {candidate:
    draft profile}); `alone`: {(candidate, kind, k): a measured one-client run's records} to replay instead."""
    target, drafts = profiles
    prompts = baseline_prompts(baseline)
    rows = []
    for row in frame.to_dict("records"):
        clients = int(row["clients"])
        if clients <= 1 or row["kind"] == "tree":
            rows.append(row)
            continue
        candidate = row["candidate"]
        point = OperatingPoint(row["method"], int(row["k"]), row["where"], row["rtt_ms"])
        reference = references.get(candidate) if row["kind"] != "none" else None
        lone = predict_step(point, target, drafts.get(candidate), reference, context, overhead_s)
        measured = (alone or {}).get((candidate, row["kind"], int(row["k"])))
        if measured is not None:
            own = from_records(measured)
        elif row["kind"] == "none":
            own = single_token_prompts(lone, prompts)
        else:
            own = reference_prompts(reference, int(row["k"]), lone, prompts)
        if not own:
            rows.append(row)
            continue
        rows.append(repriced(row, lone, run_clients(own, clients, rules), prices, power))
    return pd.DataFrame(rows, index=frame.index)


def loaded_terms(stats: Optional[dict], calibrator) -> dict:
    """How points at several clients were priced, for the report: the worker's rules the simulation played."""
    if stats is None:
        return {}
    rules = worker_rules(calibrator.profiles()[0], stats)
    return {"loaded": {"priced": "simulated against the worker's batching",
                       "wait_cap_ms": round(1000 * rules.wait_cap_s, 1), "window_ms": round(1000 * rules.window_s, 1),
                       "host_fixed_ms": round(1000 * rules.host.fixed_s, 2),
                       "host_row_ms": round(1000 * rules.host.row_s, 3)}}
