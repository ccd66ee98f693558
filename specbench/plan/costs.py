"""Cost model: prices, power and network as data; every objective a small pure function.

No torch here: the planning layer runs in notebooks without a model. Sources: AutoDraft
(user-cloud speculative decoding with a cost knob) for the objective J and its knob cs; the GPU
rental formula ($/GPU-hour x busy seconds) is the usual cloud accounting.
"""
from __future__ import annotations

from dataclasses import dataclass

from specbench.types import SpecbenchError

PRESETS = {"tps": 0.0, "balanced": 0.5, "cost": 1.0}


@dataclass(frozen=True)
class Prices:
    """Target side priced per GPU-hour (busy seconds) or per 1M tokens; draft energy and bytes on top."""

    target_usd_per_hour: float = 2.0
    target_usd_per_mtok: float = 0.0  # when > 0, API pricing per generated token replaces GPU-hours
    draft_usd_per_kwh: float = 0.30
    usd_per_gb_up: float = 0.0
    usd_per_gb_down: float = 0.09

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if value < 0:
                raise SpecbenchError(f"price {name} must be >= 0, got {value}")


@dataclass(frozen=True)
class Power:
    """Watts while busy; `source` says where the figure came from (nvml, rapl or configured)."""

    draft_watts: float = 15.0
    target_watts: float = 350.0
    source: str = "configured"


@dataclass(frozen=True)
class Network:
    rtt_ms: float = 0.0
    bandwidth_mbps: float = 0.0  # 0 = unlimited

    def transfer_s(self, bytes_up: float, bytes_down: float) -> float:
        """One round trip plus serialization of both directions."""
        wire = (bytes_up + bytes_down) * 8 / (self.bandwidth_mbps * 1e6) if self.bandwidth_mbps else 0.0
        return self.rtt_ms / 1000 + wire


@dataclass(frozen=True)
class StepCost:
    """Per-step figures of one client the objectives are built from (one target call per step);
    `clients` share that call (one batched forward), so its seconds are paid once for all of them."""

    tokens_per_step: float
    draft_s: float
    verify_s: float
    network_s: float
    overhead_s: float
    bytes_up: float
    bytes_down: float
    clients: int = 1
    # the drafting runs on the target's device (a local placement, or a method drafting on the worker), which
    # is then held, and draws its power, while it drafts; else the client's own device drafts
    drafts_on_target: bool = False

    @property
    def step_s(self) -> float:
        return self.draft_s + self.verify_s + self.network_s + self.overhead_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def target_seconds(step: StepCost) -> float:
    """Seconds of one step the target's device is held for this client: its share of the batched verify, and
    the drafting where that runs on the same device. Why the drafting: a local draft occupies the machine the
    target is priced on (billing the verify alone priced a local chain like a remote one, so a remote point
    could never be the cheaper, and made a heavy local draft look cheap; benchmarks/results/2026-12-07-local-cost.md)."""
    return step.verify_s / step.clients + (step.draft_s if step.drafts_on_target else 0.0)


def api_cost_per_mtok(step: StepCost, prices: Prices) -> float:
    """Target-side $ per 1M generated tokens: GPU $/hour x the seconds the target's device is held per token
    (`target_seconds`), or the API price."""
    if prices.target_usd_per_mtok > 0:
        return prices.target_usd_per_mtok
    return prices.target_usd_per_hour / 3600 * target_seconds(step) / step.tokens_per_step * 1e6


def draft_energy_j_per_mtok(step: StepCost, power: Power) -> float:
    """Joules spent drafting, at the power of the device that drafts (the client's, or the target's)."""
    watts = power.target_watts if step.drafts_on_target else power.draft_watts
    return watts * step.draft_s / step.tokens_per_step * 1e6


def target_energy_j_per_mtok(step: StepCost, power: Power) -> float:
    return power.target_watts * step.verify_s / (step.tokens_per_step * step.clients) * 1e6


def total_cost_per_mtok(step: StepCost, prices: Prices, power: Power) -> float:
    """api_cost + the client's drafting energy x $/kWh + bytes x $/GB each way (AutoDraft's total cost). Drafting on
    the target's device is in api_cost already (its hourly price pays its power)."""
    client_j = 0.0 if step.drafts_on_target else draft_energy_j_per_mtok(step, power)
    energy_usd = client_j / 3.6e6 * prices.draft_usd_per_kwh
    per_token_gb = 1e6 / step.tokens_per_step / 1e9
    wire_usd = (step.bytes_up * prices.usd_per_gb_up + step.bytes_down * prices.usd_per_gb_down) * per_token_gb
    return api_cost_per_mtok(step, prices) + energy_usd + wire_usd


def cost_knob(cs: float, cost: float, cost_ref: float, tps: float, tps_ref: float) -> float:
    """AutoDraft's J = cs * cost / cost_ref + (1 - cs) * tps_ref / tps; cs = 0 is pure speed, 1 pure cost."""
    check_cs(cs)
    if cost_ref <= 0 or tps <= 0 or tps_ref <= 0:
        raise SpecbenchError("cost_ref, tps and tps_ref must be > 0")
    return cs * cost / cost_ref + (1 - cs) * tps_ref / tps


def check_cs(cs: float) -> float:
    if not 0.0 <= cs <= 1.0:
        raise SpecbenchError(f"cost weight cs must be in [0, 1], got {cs}")
    return cs
