"""Replay prediction: latency profiles x acceptance references x network x prices -> operating points.

Nothing is run: a chain of K tokens accepts min(a, K) tokens on a step where a long reference
chain accepted a (exact for greedy, and exact in distribution for rejection sampling, because the
first K tokens of a longer chain are distributed as a K chain); trees are predicted only at node
budgets that were measured, never interpolated.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from specbench.plan.costs import Network, Power, Prices, StepCost, cost_knob, check_cs
from specbench.methods import get_method
from specbench.plan.objectives import by_column, cost_columns
# their home is plan/reference.py; many modules import them from here
from specbench.plan.reference import FREE_DRAFTS, LOOKUP_DRAFT, SUFFIX_DRAFT, AcceptanceReference  # noqa: F401
from specbench.types import SpecbenchError

REPLY_BYTES = 110  # verify reply: msgpack header (ok, id, bonus, timings) + accepted path frame
REQUEST_HEADER_BYTES = 150  # verify request header: op, session, seed, sampling, array descriptors


@dataclass(frozen=True)
class LatencyProfile:
    """Median forward seconds of one model on one device over a (tokens, context, batch) grid.

    A row is (tokens, context, median_s) or (tokens, context, median_s, batch): one forward of
    `batch` sequences, each adding `tokens` to its own `context`-long cache (a shared worker
    verifying `batch` clients' drafts at once). Rows without a batch are batch 1.
    """

    model: str
    device: str
    dtype: str = "float32"
    quantization: str = "none"
    rows: tuple[tuple, ...] = ()  # (tokens, context, median_s[, batch])
    weight_bytes: int = 0  # as loaded for the profile; 0 in profiles recorded before it was measured
    kv_bytes_per_token: int = 0
    forward: str = "eager"  # or fast-<backend>: fixed-shape steps (decode/fast_forward.py)
    # where it came from, not what it measured (so not compared): "shipped" (the package's profiles/) or
    # "own" (the user's folder); the sitting ("date host") it was taken in; how much its repeats spread
    # (the median over points of (max - min) / median: a busy machine spreads them, `plan/library.py`)
    origin: str = field(default="", compare=False)
    sitting: str = field(default="", compare=False)
    noise: Optional[float] = field(default=None, compare=False)

    def memory_bytes(self, context: int, batch: int = 1) -> int:
        """Weights plus `batch` caches of `context` tokens: what the model needs on its device."""
        return self.weight_bytes + batch * context * self.kv_bytes_per_token

    @property
    def batches(self) -> list[int]:
        return sorted({row[3] if len(row) > 3 else 1 for row in self.rows})

    def rows_of(self, batch: int) -> list[tuple]:
        """The rows timed at `batch` sequences (a row without a batch is batch 1)."""
        return [row for row in self.rows if (row[3] if len(row) > 3 else 1) == batch]

    def forward_s(self, tokens: int, context: int, batch: int = 1) -> float:
        """Linear in tokens between measured points (beyond the grid: the last slope), nearest measured
        context at or above `context` (the largest if none), linear in batch between measured batch
        sizes (beyond: the last slope). A profile of batch 1 only predicts no gain from batching:
        `batch` forwards one after another. Example: 0.10 s at batch 1 and 0.20 s at batch 4 give
        0.233 s at batch 5 (the last slope, 0.033 s per sequence)."""
        if not self.rows:
            raise SpecbenchError(f"latency profile of {self.model} on {self.device} has no rows")
        measured = self.batches
        if measured == [1]:
            return batch * self._at(tokens, context, 1)
        return _linear(measured, [self._at(tokens, context, b) for b in measured], batch)

    def _at(self, tokens: int, context: int, batch: int) -> float:
        rows = self.rows_of(batch)
        contexts = sorted({row[1] for row in rows})
        chosen = contexts[min(bisect.bisect_left(contexts, context), len(contexts) - 1)]
        points = sorted((row[0], row[2]) for row in rows if row[1] == chosen)
        return _linear([t for t, _ in points], [s for _, s in points], tokens)


def _linear(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), ascending xs; the end slopes beyond them; never below 0."""
    if len(xs) == 1:
        return ys[0]
    index = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class OperatingPoint:
    """What the predictor prices: a method of the table (its kind, `none`, `chain` or `tree`, decides how:
    `target-only`, `chain` and `tree` are the kinds' plain methods), its size, its place and its load."""

    method: str  # a method of the table: target-only | chain | tree, or any of their kinds
    k: int = 0  # chain length or tree node budget
    where: str = "local"  # local | remote
    rtt_ms: float = 0.0
    rule: str = "greedy"
    clients: int = 1  # clients sharing the target, their verifies batched into one forward
    # a draft head drafting on the client of a remote target: bytes of one position's feature row, sent
    # back for each position a verify commits (layers x hidden x 2 in float16)
    feature_bytes: int = 0

    @property
    def kind(self) -> str:
        return get_method(self.method).kind

    @property
    def drafts_on_target(self) -> bool:
        """Whether its drafting runs on the target's device (placed locally, or a method drafting on the worker)."""
        return self.where == "local" or get_method(self.method).on_worker

    @property
    def label(self) -> str:
        size = "" if self.kind == "none" else f" {'K' if self.kind == 'chain' else 'budget'}={self.k}"
        place = "local" if self.where == "local" else f"remote {self.rtt_ms:g}ms"
        shared = f", {self.clients} clients" if self.clients > 1 else ""
        return f"{self.method}{size} ({place}{shared})"


def bytes_per_step(point: OperatingPoint, draft_top_k: int = 32, accepted: float = 0.0) -> tuple[float, float]:
    """Wire bytes up and down for one verify: tokens int32 + parents int16 (+ sparse q for rejection), and
    a client-side head's feature rows for the `accepted` + 1 positions it commits. A method that runs on
    the worker sends its emitted tokens only (int32 each), once per request."""
    if point.where == "local":
        return 0.0, 0.0
    if get_method(point.method).on_worker:
        return 0.0, 4.0 * (1.0 + accepted)
    nodes = point.k if point.kind != "none" else 0
    q_bytes = nodes * (2 + draft_top_k * 8 + 2) if point.rule == "rejection" else 0
    features = point.feature_bytes * (1.0 + accepted)
    return float(REQUEST_HEADER_BYTES + nodes * 6 + q_bytes), float(REPLY_BYTES + 2 * nodes + features)


def predict_step(point: OperatingPoint, target: LatencyProfile, draft: Optional[LatencyProfile],
                 reference: Optional[AcceptanceReference], context: int = 256,
                 overhead_s: float = 0.0, bandwidth_mbps: float = 0.0) -> StepCost:
    if reference is not None and reference.prices_hybrid(point.method):
        return hybrid_step(point, target, draft, reference, context, overhead_s, bandwidth_mbps)
    lookup = reference is not None and reference.draft in FREE_DRAFTS  # drafting is free: no draft profile
    steps = reference.steps_at(point.k) if reference is not None and point.kind == "chain" else ()
    if lookup and point.kind == "tree":  # a free draft's tree grows as far as it finds: priced step by step
        steps = reference.tree_steps_at(point.k)
    accepted = reference.accepted(point.method, point.k) if reference and not steps else 0.0
    if point.kind != "none" and (reference is None or (draft is None and not lookup)):
        raise SpecbenchError(f"{point.label} needs a draft profile and an acceptance reference")
    depth, width = 1.0, 1
    if point.kind == "tree":
        depth = float(reference.tree_depth.get(point.k) or reference.tree_depth.get(str(point.k)) or 1)
        width = int(reference.tree_width.get(point.k) or reference.tree_width.get(str(point.k)) or 1)
    full = reference.full_acceptance(point.k) if reference and point.kind == "chain" else 0.0
    hit = reference.hit_rate(point.k) if reference and point.kind == "chain" else 1.0
    if steps:  # a run's own steps at this K: partial and capped drafts priced as they are, not as full ones
        shares = {d: n / len(steps) for d, n in Counter(drafted for drafted, _ in steps).items()}
        return step_cost(point, target, draft, sum(a for _, a in steps) / len(steps), context, overhead_s,
                         bandwidth_mbps, draft_per_target=reference.draft_per_target, full_accept=full,
                         drafted=shares)
    return step_cost(point, target, draft, accepted * hit, context, overhead_s, bandwidth_mbps, depth, width,
                     reference.draft_per_target if reference else 1.0, full, hit)


def network_seconds(point: OperatingPoint, bandwidth_mbps: float, up: float, down: float) -> float:
    """A step's time on the wire at `point`: its round trip and bytes, remote; a worker-side method pays one round
    trip per request, not per step, so its steps are priced as their bytes' transfer alone; 0 locally."""
    if point.where != "remote":
        return 0.0
    on_worker = get_method(point.method).on_worker
    return Network(0.0 if on_worker else point.rtt_ms, bandwidth_mbps).transfer_s(up, down)


def hybrid_step(point: OperatingPoint, target: LatencyProfile, draft: Optional[LatencyProfile],
                reference: AcceptanceReference, context: int = 256, overhead_s: float = 0.0,
                bandwidth_mbps: float = 0.0) -> StepCost:
    """Suffix decoding's hybrid priced by its recorded steps, each as it ran: suffix decoding's verify 1 + their
    nodes and draft nothing; the draft's first catch up on what it has not read (the last bonus, the tokens suffix
    decoding's steps since its own last one emitted: one forward over them), then draft a chain of their tokens or a
    tree of their depth, and verify 1 + their nodes. The mean step is the sum over steps over their number."""
    steps, prompts = reference.hybrid_steps_at(point.k)
    if not steps:
        raise SpecbenchError(f"no recorded steps of {point.method} at budget {point.k} (recorded: "
                             f"{sorted(int(b) for b in reference.hybrid_steps)})")
    if draft is None:
        raise SpecbenchError(f"{point.label} needs its draft's profile: the draft's steps cost its forwards")
    ratio, width = reference.draft_per_target, max(1, reference.hybrid_width)
    shapes, unread = Counter(), {}  # (by the draft, nodes, accepted, depth, tokens to catch up on) -> steps
    for (by_draft, nodes, accepted, depth), prompt in zip(steps, prompts or [None] * len(steps)):
        if by_draft:
            shapes[(1, nodes, accepted, depth, unread.get(prompt, 1))] += 1
            unread[prompt] = 1 + int(nodes > 0 and accepted == nodes)  # the bonus, and a chain's last token if kept
        else:
            shapes[(0, nodes, accepted, 0, 0)] += 1
            unread[prompt] = unread.get(prompt, 1) + accepted + 1
    total = [0.0] * 6  # accepted, draft_s, verify_s, network_s, bytes up, bytes down
    for (by_draft, nodes, accepted, depth, behind), count in shapes.items():
        draft_s = 0.0
        if by_draft:
            later = (max(1, depth) - 1) * draft.forward_s(width, context) if width > 1 else \
                max(0.0, nodes * ratio - 1) * draft.forward_s(1, context)
            draft_s = draft.forward_s(behind * ratio, context) + later
        up, down = bytes_per_step(replace(point, k=nodes), accepted=accepted)
        figures = (accepted, draft_s, target.forward_s(1 + nodes, context, point.clients),
                   network_seconds(point, bandwidth_mbps, up, down), up, down)
        total = [sum_ + count * value for sum_, value in zip(total, figures)]
    mean_ = [value / len(steps) for value in total]
    return StepCost(1.0 + mean_[0], mean_[1], mean_[2], mean_[3], overhead_s, mean_[4], mean_[5], point.clients,
                    point.drafts_on_target)


def step_cost(point: OperatingPoint, target: LatencyProfile, draft: Optional[LatencyProfile], accepted: float,
              context: int = 256, overhead_s: float = 0.0, bandwidth_mbps: float = 0.0,
              tree_depth: float = 1.0, tree_width: int = 1, draft_per_target: float = 1.0,
              full_accept: float = 0.0, hit: float = 1.0, drafted: Optional[dict] = None) -> StepCost:
    """Seconds and bytes of one step at `point` when `accepted` drafts are accepted on average: the
    cost model that replay prediction and the per-step planner share. `draft_per_target`: draft-model
    tokens per proposed target token (1 unless the draft has another tokenizer); `full_accept`: the
    share of chain steps whose every draft token is accepted. No `draft` profile for a chain: drafting
    costs the step nothing (prompt lookup copies tokens from the context). `hit`: the share of chain
    steps that draft at all (prompt lookup's matches); the rest verify one token. `drafted`: {tokens drafted:
    share of steps} where a run's steps are known (partial matches, each output's capped last steps): each
    verifies 1 + its drafts and a draft model drafts that many, instead of K and `hit` (a tree of prompt lookup
    or suffix decoding: 1 + its nodes)."""
    if point.kind == "chain" and draft is not None:
        # The draft's cache keeps the chain it fed (all but its last token), so its first forward
        # catches up on the bonus alone, or on its last token and the bonus after a fully accepted chain.
        def drafting(tokens: float) -> float:
            forwards = max(1.0, tokens * draft_per_target)
            return (draft.forward_s((1 + full_accept) * draft_per_target, context)
                    + (forwards - 1) * draft.forward_s(1, context))

        draft_s = (sum(share * drafting(d) for d, share in drafted.items() if d > 0) if drafted
                   else drafting(point.k))
    elif point.kind == "tree" and draft is not None:
        draft_s = draft.forward_s(1, context) + (tree_depth - 1) * draft.forward_s(tree_width, context)
    else:
        draft_s = 0.0
    # every client's verify in one batched forward: each waits for the whole batch
    verify_s = target.forward_s(1 + (point.k if point.kind != "none" else 0), context, point.clients)
    if drafted and (point.kind == "chain" or draft is None):  # a free draft's tree of d nodes verifies 1 + d
        verify_s = sum(share * target.forward_s(1 + d, context, point.clients) for d, share in drafted.items())
    elif hit < 1.0 and point.kind == "chain":
        verify_s = hit * verify_s + (1 - hit) * target.forward_s(1, context, point.clients)
    up, down = bytes_per_step(point, accepted=accepted)
    network_s = network_seconds(point, bandwidth_mbps, up, down)
    return StepCost(1.0 + accepted, draft_s, verify_s, network_s, overhead_s, up, down, point.clients,
                    point.drafts_on_target)


def predict(points: Sequence[OperatingPoint], target: LatencyProfile, draft: Optional[LatencyProfile],
            reference: Optional[AcceptanceReference], prices: Prices = Prices(), power: Power = Power(),
            context: int = 256, overhead_s: float = 0.0, bandwidth_mbps: float = 0.0) -> list[dict]:
    """One row per operating point: tokens/s, tokens per step, $ and J per 1M tokens, bytes per token."""
    rows = []
    for point in points:
        step = predict_step(point, target, draft, reference, context, overhead_s, bandwidth_mbps)
        rows.append({"label": point.label, "method": point.method, "kind": point.kind, "k": point.k,
                     "where": point.where, "rtt_ms": point.rtt_ms, "clients": point.clients,
                     **priced(step, prices, power)})
    return rows


def priced(step: StepCost, prices: Prices, power: Power) -> dict:
    """Speed, $, J and bytes of one step per the cost model: the columns predictions and measurements share."""
    return {"tokens_per_step": step.tokens_per_step, "tokens_per_s": step.tokens_per_s, "step_ms": 1000 * step.step_s,
            "aggregate_tokens_per_s": step.clients * step.tokens_per_s, **cost_columns(step, prices, power),
            "bytes_per_token": (step.bytes_up + step.bytes_down) / step.tokens_per_step,
            "energy_source": power.source}


def pareto_front(rows: Sequence[dict], speed: str = "tokens_per_s", cost: str = "total_cost_usd_per_mtok") -> list[dict]:
    """Rows not dominated by another (at least as fast and at most as costly, one strictly)."""
    front = []
    for row in rows:
        dominated = any(other[speed] >= row[speed] and other[cost] <= row[cost]
                        and (other[speed] > row[speed] or other[cost] < row[cost]) for other in rows)
        if not dominated:
            front.append(row)
    return sorted(front, key=lambda r: r[speed])


def choose(rows: Sequence[dict], cs: float, cost: str = "total_cost_usd_per_mtok",
           reference_label: Optional[str] = None) -> dict:
    """The row minimising AutoDraft's J for cost weight cs; references default to target-only's row.

    The rule: J = cs * cost / C + (1 - cs) * T / tokens_per_s, where T and C are the reference row's
    (target-only at the first place listed) speed and cost, so each point's J depends on that point
    and the reference only: showing or hiding another draft moves the recommendation only when that
    draft is, or was, the minimum. An objective that is zero at the reference (target-only spends no
    draft energy) is scaled by the energy the reference spends per token on the target instead, still
    a property of the reference; when every point costs nothing, speed alone decides."""
    if not rows:
        raise SpecbenchError("no operating points to choose from")
    values = knob_values(rows, cs, cost, reference_label)
    return rows[values.index(min(values))]


def knob_values(rows: Sequence[dict], cs: float, cost: str = "total_cost_usd_per_mtok",
                reference_label: Optional[str] = None) -> list[float]:
    """Each row's J at cs, as `choose` ranks them (the same reference row and scaling)."""
    check_cs(cs)
    base = next((r for r in rows if r["label"] == reference_label), None) if reference_label else None
    base = base or next((r for r in rows if r.get("kind") == "none"), rows[0])
    objective = by_column(cost)
    cost_ref = base[cost] if base[cost] > 0 else base.get(objective.free_scale, 0.0) if objective else 0.0
    if cost_ref <= 0 or all(r[cost] <= 0 for r in rows):
        cost_ref, cs = 1.0, 0.0
    return [cost_knob(cs, r[cost], cost_ref, r["tokens_per_s"], base["tokens_per_s"]) for r in rows]


def break_even_acceptance(target: LatencyProfile, draft: LatencyProfile, k: int, context: int = 256,
                          rtt_ms: float = 0.0, overhead_s: float = 0.0) -> float:
    """Mean accepted tokens per step at which chain K merely matches target-only tokens/s.

    SD pays off only above it: (1 + a) / (draft + verify(K+1) + net) = 1 / (verify(1) + net).
    """
    net = rtt_ms / 1000
    baseline_step = target.forward_s(1, context) + net + overhead_s
    sd_step = k * draft.forward_s(1, context) + target.forward_s(k + 1, context) + net + overhead_s
    return sd_step / baseline_step - 1.0


@dataclass(frozen=True)
class HostCost:
    """A shared worker's own work per verify round outside the forward (parsing, per-row checks and
    verdicts, replies): `fixed_s` + `row_s` per row, as the worker fits it on its rounds (its `stats`:
    `host_fixed_s`, `host_row_s`). Why: on a GPU a forward takes a few ms and this work, in Python, is a
    large share of a loaded round (an H100 worker at 8 clients ran at a third of its profile's forecast);
    on a CPU it is under 1% of a step."""

    fixed_s: float = 0.0
    row_s: float = 0.0

    def at(self, rows: float) -> float:
        return self.fixed_s + self.row_s * rows

    def beyond_one(self) -> "HostCost":
        """What a round of several rows costs over a lone one: for replaying records of a run through the
        same worker alone, whose steps already hold a one-row round's work (in their `overhead_s`)."""
        return HostCost(-self.row_s, self.row_s)

    @classmethod
    def from_stats(cls, stats: dict) -> "HostCost":
        """From a worker's `stats` reply; nothing (0) while it has too few rounds of differing sizes to fit."""
        return cls(float(stats.get("host_fixed_s") or 0.0), float(stats.get("host_row_s") or 0.0))
