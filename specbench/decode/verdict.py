"""Why a method ran faster or slower than target-only, in one sentence computed from its own records.

Why: a notebook where speculative decoding loses (a 26-layer self-draft of a 30-layer model, a
draft on a 2-core CPU) must say so and say why, or a reader takes the loss for a bug. The step
model is the predictor's: an SD step costs its drafting plus a verify of its K+1 tokens plus the
network, and returns `tokens_per_step` tokens; target-only's step costs one forward plus the network
and returns one. With t = target-only's forward, c = drafting per drafted token, v = the SD verify
over t, K = drafted tokens per step, n = network per step:

    speedup ~= tokens_per_step * (t + n) / (K * c + v * t + n)

Example: t = 50 ms, c = 40 ms (0.8 of a forward), v = 1.3, K = 4, n = 0, 2.2 tokens per step:
2.2 * 50 / (160 + 65) = 0.49x; the draft would have to cost under (2.2 * 50 - 65) / 4 = 11 ms
(0.22 of a forward) to pay at that acceptance.
"""
from __future__ import annotations

import pandas as pd

from specbench.decode.metrics import tokens_per_second, tokens_per_step


def speed_verdicts(records: pd.DataFrame, by: str | None = None) -> list[str]:
    """One sentence per speculative method (per value of `by`, e.g. the emulated RTT), against the
    target-only run of the same group; empty where no target-only ran beside it."""
    groups = records.groupby(by, sort=False) if by else [(None, records)]
    sentences = []
    for key, group in groups:
        base = group[group["kind"] == "none"]
        if base.empty:
            continue
        where = f" at {by} {key}" if by else ""
        for method, steps in group[group["kind"] != "none"].groupby("method", sort=False):
            sentences.append(_verdict(method + where, steps, base))
    return sentences


def _verdict(name: str, steps: pd.DataFrame, base: pd.DataFrame) -> str:
    speedup = tokens_per_second(steps) / tokens_per_second(base)
    forward = base["target_forward_s"].mean()
    network = base["network_s"].mean()
    drafted = steps["drafted"].sum()
    per_step = steps["drafted"].mean()
    draft_share = steps["draft_s"].sum() / drafted / forward if drafted else 0.0
    verify_ratio = steps["target_forward_s"].mean() / forward
    returned = tokens_per_step(steps)
    most = round(per_step + 1, 1)  # tokens a step returns at most, on average (lookup drafts vary step to step)
    costs = (f"each drafted token costs {draft_share:.2f} of a target forward, a verify {verify_ratio:.2f} of one, "
             f"and a step returns {returned:.2f} tokens for {per_step:.1f} drafted")
    costs += _who_drafted(steps)
    if speedup >= 1.0:
        return f"{name} is {speedup:.2f}x target-only: {costs}."
    affordable = (returned * (forward + network) - verify_ratio * forward - network) / per_step if per_step else 0
    needed = (per_step * draft_share * forward + verify_ratio * forward + network) / (forward + network)
    if needed > per_step + 1:
        fix = (f"at this draft cost no acceptance pays (a step would have to return {needed:.2f} tokens, more than "
               f"the {most:g} it can); a cheaper draft is where to look")
    elif affordable <= 0:
        fix = (f"no draft is cheap enough at this acceptance (the verify alone costs more than the tokens it "
               f"returns); it pays from {needed:.2f} tokens per step (of at most {most:g})")
    else:
        fix = (f"it would pay with drafting under {affordable / forward:.2f} of a target forward per token at this "
               f"acceptance, or {needed:.2f} tokens per step (of at most {most:g}) at this draft cost")
    return (f"{name} is {speedup:.2f}x target-only, slower, because {costs}: {fix} (notebook 03's break-even "
            f"table gives it per K and RTT).")


def _who_drafted(steps: pd.DataFrame) -> str:
    """A hybrid's split of its steps between suffix decoding and its draft (`draft_source`), with what each returned:
    where the draft's steps return little, a lower `hand_over` or a higher `bench_below` gives more steps to suffix
    decoding, and the other way round."""
    sources = steps["draft_source"] if "draft_source" in steps else pd.Series(dtype=str)
    if not sources.isin(["suffix", "other"]).any():
        return ""
    parts = [f"{label} {int((sources == source).sum())} of {len(steps)} steps "
             f"({tokens_per_step(steps[sources == source]):.2f} tokens a step)"
             for source, label in (("suffix", "suffix decoding drafted"), ("other", "the draft"))
             if (sources == source).any()]
    return " (" + ", ".join(parts) + ")"


def rtt_order_note(records: pd.DataFrame, rtt: str = "emulated_rtt_ms") -> str:
    """Whether target-only slowed as the emulated RTT grew, as it must, or this machine's own noise
    (step times moving between runs) was larger than the delay added: a reader should not take a
    faster run at 100 ms than at 10 ms for a finding. Compares each run's speed with what its 0-RTT
    step plus the added delay predicts."""
    base = records[records["kind"] == "none"]
    speeds = {value: tokens_per_second(group) for value, group in base.groupby(rtt)}
    if len(speeds) < 2:
        return "one RTT only: nothing to order"
    values = sorted(speeds)
    inverted = [(a, b) for a, b in zip(values, values[1:]) if speeds[b] > speeds[a]]
    step = base[base[rtt] == values[0]]["step_s"].median()
    noise = base.groupby(rtt)["step_s"].median().sub([step + (v - values[0]) / 1000 for v in values]).abs().max()
    if not inverted:
        return (f"target-only slowed as the RTT grew, as it must ({', '.join(f'{speeds[v]:.2f}' for v in values)} "
                f"tok/s at {values} ms); its median steps stayed within {1000 * noise:.0f} ms of a 0-RTT step plus "
                f"the delay")
    pairs = "; ".join(f"{speeds[b]:.2f} tok/s at {b} ms vs {speeds[a]:.2f} at {a} ms" for a, b in inverted)
    return (f"noise: target-only ran faster at a larger RTT ({pairs}); the delay is added on the client, so "
            f"the difference is this machine's own speed moving between runs (medians up to {1000 * noise:.0f} ms "
            f"off a 0-RTT step plus the delay): repeat on a quiet machine before reading the RTT trend")
