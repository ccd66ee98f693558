"""Per-step choice of draft length (AutoDraft's per-step planning): before every step, pick the
chain length K (0 = no draft, a plain target step) that minimises the cost knob J for that step.

Why per step and not per run: the best K moves with the context length (forward latency grows
with it), with the network (RTT measured on the way) and with how well the draft is doing on
*this* text. The acceptance model starts from a reference's per-position acceptance and updates
with every verdict, so a prompt the draft handles badly quickly falls back to K=0 or 1, and an
easy one (code, repetition) climbs to long chains. Choosing K never changes the output: every
step is verified losslessly whatever K is.

Acceptance model: alpha_i = P(position i accepted | positions < i accepted), i = 1..max_k, kept as
Beta counts (successes, trials) seeded from the reference with weight `prior_steps`, all decayed
by `forget` per observed step, so recent steps count more and the prior fades; after `explore_after` plain steps
in a row one token is drafted, so a planner that gave up on the draft can notice it improve. Expected accepted drafts for K:
E[a_K] = sum_{i<=K} prod_{j<=i} alpha_j (Leviathan et al., 2023, with position-wise rates).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specbench.models.spec import acceptance_label
from specbench.plan.costs import Power, Prices, check_cs, cost_knob
from specbench.plan.explore import cost_column
from specbench.plan.predict import FREE_DRAFTS, AcceptanceReference, LatencyProfile, OperatingPoint, priced, step_cost
from specbench.types import SpecbenchError


def positional_rates(reference: AcceptanceReference, max_k: int) -> list[tuple[float, float]]:
    """(accepted, tried) counts per position 1..max_k from the reference's long-chain steps."""
    if not reference.chain_accepts:
        raise SpecbenchError(f"reference {reference.draft} -> {reference.target} has no chain steps to plan from")
    if max_k > reference.max_chain:
        raise SpecbenchError(f"reference chains were {reference.max_chain} long; cannot plan up to K={max_k}")
    counts = []
    for position in range(1, max_k + 1):
        tried = sum(1 for a in reference.chain_accepts if a >= position - 1)
        accepted = sum(1 for a in reference.chain_accepts if a >= position)
        counts.append((float(accepted), float(tried)))
    return counts


@dataclass
class StepPlanner:
    """Chooses K per step for one draft/target pair from latency profiles, live acceptance and live RTT."""

    target: LatencyProfile
    draft: Optional[LatencyProfile]  # None: drafting is free (prompt lookup), only verify width is priced
    reference: AcceptanceReference
    cs: float = 0.0
    max_k: int = 6
    where: str = "local"
    rtt_ms: float = 0.0  # starting estimate; remote steps update it from measured network time
    prices: Prices = field(default_factory=Prices)
    power: Power = field(default_factory=Power)
    cost: str = "total_cost"
    prior_steps: float = 8.0  # how many steps the reference is worth against live evidence
    forget: float = 0.9  # per-step decay of live evidence (1 = never forget)
    overhead_s: float = 0.0
    rtt_smoothing: float = 0.3
    explore_after: int = 8  # after this many K=0 steps in a row, draft one token to re-check acceptance
    clients: float = 1.0  # starting estimate of the worker's batch size; remote steps update it
    # The draft device's memory: K is only chosen where the draft's weights plus its cache of the
    # context and K drafted tokens fit (None: no limit); beyond it the step is a plain target step.
    draft_budget_bytes: Optional[int] = None

    def __post_init__(self):
        check_cs(self.cs)
        if self.max_k < 1:
            raise SpecbenchError(f"max_k must be >= 1, got {self.max_k}")
        if self.where not in ("local", "remote"):
            raise SpecbenchError(f"where must be 'local' or 'remote', got {self.where!r}")
        if not 0 < self.forget <= 1:
            raise SpecbenchError(f"forget must be in (0, 1], got {self.forget}")
        if self.draft is None and self.reference.draft not in FREE_DRAFTS:
            raise SpecbenchError(f"a planner without a draft profile plans prompt lookup; the reference is of "
                                 f"draft {self.reference.draft!r}: pass that draft's profile")
        if self.draft_budget_bytes is not None:
            if self.draft is None:
                raise SpecbenchError("a draft memory budget bounds a draft model; prompt lookup holds none")
            if not self.draft.weight_bytes:
                raise SpecbenchError(
                    f"a draft memory budget needs the draft's measured memory, and the profile of "
                    f"{self.draft.model} on {self.draft.device} has none: record it again with `specbench profile`")
            if self.draft.weight_bytes > self.draft_budget_bytes:
                raise SpecbenchError(
                    f"draft {self.draft.model} does not fit the draft memory budget: its weights take "
                    f"{self.draft.weight_bytes / 2**20:.1f} MiB, the budget is {self.draft_budget_bytes / 2**20:.1f} MiB "
                    f"(a quantized variant of the draft may fit)")
        self.cost_name = cost_column(self.cost)
        self.reset()

    def reset(self) -> None:
        """Back to the reference prior (e.g. between prompts); live evidence is dropped."""
        counts = positional_rates(self.reference, self.max_k)
        scale = self.prior_steps / len(self.reference.chain_accepts)
        self.counts = [(a * scale, t * scale) for a, t in counts]
        self.history: list[int] = []

    def rates(self) -> list[float]:
        """Current alpha_i per position: decayed counts plus one pseudo-trial at 1/2, so a position
        with no recent evidence drifts back towards a coin flip instead of keeping an old certainty."""
        return [(accepted + 0.5) / (tried + 1.0) for accepted, tried in self.counts]

    def survival(self) -> list[float]:
        """P(positions 1..i all accepted) = prod_{j<=i} alpha_j, for i = 0..max_k (1 at i = 0)."""
        survive = [1.0]
        for alpha in self.rates():
            survive.append(survive[-1] * alpha)
        return survive

    def scores(self, context: int) -> list[dict]:
        """Every candidate K with its predicted speed, cost and J at this context (K=0 is the reference)."""
        rows, survive = [], self.survival()
        for k in range(self.max_k + 1):
            point = OperatingPoint("target-only" if k == 0 else "chain", k, self.where, self.rtt_ms,
                                   clients=max(1, round(self.clients)))
            step = step_cost(point, self.target, self.draft, sum(survive[1:k + 1]), context, self.overhead_s,
                             draft_per_target=self.reference.draft_per_target, full_accept=survive[k])
            rows.append({"k": k, "fits": self.fits(k, context), **priced(step, self.prices, self.power)})
        base = rows[0]
        for row in rows:
            row["J"] = cost_knob(self.cs, row[self.cost_name], base[self.cost_name], row["tokens_per_s"],
                                 base["tokens_per_s"])
        return rows

    def fits(self, k: int, context: int) -> bool:
        """Whether drafting K tokens at this context fits the draft budget (K=0 drafts nothing)."""
        if k == 0 or self.draft_budget_bytes is None:
            return True
        return self.draft.memory_bytes(context + k) <= self.draft_budget_bytes

    def profile_note(self, device: str, dtype: Optional[str] = None) -> Optional[str]:
        """Why the K this planner chooses may not suit a target on `device` in `dtype` (None: unknown): its
        target's profile was measured on another device or in another dtype. None where they match."""
        differs = ([f"on {self.target.device}, and the target runs on {device}"] if self.target.device != device
                   else []) + ([f"in {self.target.dtype}, and the target runs in {dtype}"]
                               if dtype and self.target.dtype != dtype else [])
        if not differs:
            return None
        return (f"the step planner prices K from a profile of {self.target.model} measured {'; '.join(differs)}: its "
                f"K may not suit this target; record a profile here (`specbench profile`)")

    def choose(self, context: int) -> int:
        """K for the next step (0 = verify no draft: a plain target step)."""
        best = min((row for row in self.scores(context) if row["fits"]), key=lambda row: (row["J"], row["k"]))["k"]
        recent = self.history[-self.explore_after:]
        if (best == 0 and self.explore_after and len(recent) == self.explore_after and not any(recent)
                and self.fits(1, context)):
            best = 1  # without drafting, acceptance evidence never changes: probe now and then
        self.history.append(best)
        return best

    def observe(self, drafted: int, accepted: int, network_s: Optional[float] = None, batch_size: int = 1) -> None:
        """Fold one verdict in: positions 1..accepted+1 were tried (up to drafted), 1..accepted passed.
        `batch_size` (how many verifies shared the worker's forward) tracks the worker's load: under
        load every verified token costs a batched forward, so shorter drafts win (SmartSpec's goodput
        argument), which the cost model sees through the profile's batch-size grid."""
        self.counts = [(a * self.forget, t * self.forget) for a, t in self.counts]
        for position in range(1, min(drafted, self.max_k) + 1):
            if position > accepted + 1:
                break
            a, t = self.counts[position - 1]
            self.counts[position - 1] = (a + (1.0 if position <= accepted else 0.0), t + 1.0)
        if network_s is not None and network_s > 0 and self.where == "remote":
            self.rtt_ms += self.rtt_smoothing * (1000 * network_s - self.rtt_ms)
        if self.where == "remote":
            self.clients += self.rtt_smoothing * (batch_size - self.clients)


def planner_from_caches(target: str, draft: str, dataset: Optional[str] = None, device: Optional[str] = None,
                        draft_budget_mib: Optional[float] = None, dtype: Optional[str] = None,
                        prefer: Optional[str] = None, **options) -> StepPlanner:
    """A StepPlanner from the shipped/recorded `profiles/` and `reference/` for this pair;
    `draft_budget_mib` bounds the draft's memory (weights + its cache), see `StepPlanner`. Without a
    `device`, the `prefer` device's profiles (this CPU's unless named) are preferred where they exist. `draft`
    "prompt-lookup" plans prompt lookup: only the target's profile is needed, and under a shared
    worker's load it is what shortens the lookups (every drafted token widens the batched verify).
    `dataset` "<name>/<family>": the reference narrowed to one family's prompts."""
    from specbench.plan.explore import cached_pairs
    from specbench.plan.library import load_profiles, load_references

    # a dataset "<name>/<family>" names one family of a reference that recorded its prompts' families
    pairs = cached_pairs(load_profiles(), load_references(by_family=bool(dataset), target=acceptance_label(target),
                                                          draft=acceptance_label(draft)),
                         target, draft, dataset=dataset, device=device, dtype=dtype, prefer=prefer)
    if not pairs:
        raise SpecbenchError(f"no cached profiles + reference for draft {draft!r} -> target {target!r}"
                             f"{f' on {dataset!r}' if dataset else ''}{f' on device {device!r}' if device else ''}"
                             f"{f' in {dtype}' if dtype else ''}; record them with `specbench profile` and "
                             f"`specbench reference`")
    target_profile, draft_profile, reference = pairs[0]
    options.setdefault("max_k", min(6, reference.max_chain))
    if draft_budget_mib is not None:
        options["draft_budget_bytes"] = int(draft_budget_mib * 2**20)
    return StepPlanner(target_profile, draft_profile, reference, **options)


def planner_note(planner, target) -> Optional[str]:
    """`StepPlanner.profile_note` for the target a run steps: a LocalTarget's model here, or a worker's as it
    reports itself; None for a planner of another kind or a target that says neither."""
    from specbench.hardware import on_worker, target_device

    if not hasattr(planner, "profile_note"):
        return None
    if on_worker(target):
        dtype = target.info.get("dtype")
    elif getattr(target, "loaded", None) is not None:
        dtype = target.loaded.spec.dtype
    else:
        return None
    return planner.profile_note(target_device(target), dtype)
