"""A tune's profiles brought to this machine's speed now, from a target-only run measured in the window
of the runs they predict.

Why: a CPU's speed drifts within hours, so a profile taken at another moment predicts another machine.
By default (`runs`) one factor, the run's in-loop 1-token forward over the profile's, scales the
target's profile and each draft's 1-token forward is re-timed; then every point the tune measures
teaches the rest: its steps give the target's in-loop forward at each width it verified and its
draft's in-loop cost, and the points measured after it are priced with those (`learn`); a run of several
clients through a worker teaches the batch grid from the worker's rounds (`learn_rounds`). `speed` stops
after the first part. Two modes re-time forwards separately, every width after the run (`widths`)
and each point's widths just before it runs (`per-point`); on the 2-core VM of 2026-11-26 both predicted
worse than one factor (a separately timed forward is not the loop's, and a few repeats carry more
noise than the drift: benchmarks/results/2026-11-26-tune-calibration.md), so they are options. No
mode prices a point from the run it predicts.
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field, replace
from typing import Optional

import pandas as pd

from specbench.decode.metrics import reply_position

DRAFT_WIDTHS = (1, 2)  # a draft's forwards: one token per drafted position, the catch-up after a full accept
MODES = ("runs", "speed", "widths", "per-point")  # what the calibration learns from: see `Calibrator`
MIN_STEPS = 10  # a width's steps in one run before that run's median forward at it counts


def scaled(profile, factors: dict, batch_factors: Optional[dict] = None):
    """`profile` with each row's time multiplied by its width's factor (`factor_at`); a row of several sequences,
    where `batch_factors` ({batch: factor}) were learned, by the factor at its batch between its width's (batch 1)
    and the learned batches'."""
    def factor(row) -> float:
        lone = factor_at(factors, row[0])
        batch = row[3] if len(row) > 3 else 1
        return lone if batch <= 1 or not batch_factors else factor_at({1: lone, **batch_factors}, batch)

    return replace(profile, rows=tuple((r[0], r[1], r[2] * factor(r), *r[3:]) for r in profile.rows))


def factor_at(factors: dict, width: int) -> float:
    """The factor of `width`: linear between re-timed widths, the nearest one's beyond them.
    Example: {1: 0.8, 5: 0.9} gives 0.85 at width 3 and 0.9 at width 8."""
    widths = sorted(factors)
    if width <= widths[0]:
        return factors[widths[0]]
    if width >= widths[-1]:
        return factors[widths[-1]]
    index = bisect.bisect_left(widths, width)
    low, high = widths[index - 1], widths[index]
    return factors[low] + (factors[high] - factors[low]) * (width - low) / (high - low)


def worker_rounds(records: pd.DataFrame) -> pd.DataFrame:
    """The worker's rounds in a run's steps: (rows, forward_s, width, context) per round, its rows' mean width
    (tokens verified) and context. A round's rows carry the worker's number for it (`batch_round`; records
    without one are grouped by forward time and batch size, which two rounds share now and then to the
    nanosecond); a group whose size is not its batch size (a row of another run) is dropped."""
    columns = ["rows", "forward_s", "width", "context"]
    if records.empty or "batch_size" not in records or "client" not in records:
        return pd.DataFrame(columns=columns)
    steps = records.assign(width=records["drafted"].fillna(0) + 1)
    before = reply_position(steps, keys=("client", "prompt_index"))
    steps = steps.assign(context=steps["prompt_tokens"] + before)
    numbered = "batch_round" in steps and bool((steps["batch_round"] >= 0).all())
    found = steps.groupby(["batch_round" if numbered else "target_forward_s", "batch_size"]).agg(
        forward=("target_forward_s", "first"), count=("width", "size"), width=("width", "mean"),
        context=("context", "mean")).reset_index()
    found = found[found["count"] == found["batch_size"]]
    return pd.DataFrame({"rows": found["batch_size"].astype(int), "forward_s": found["forward"],
                         "width": found["width"], "context": found["context"]})[columns].reset_index(drop=True)


def draft_factor(profile, records: pd.DataFrame, context: int) -> Optional[float]:
    """A run's in-loop drafting time over what `profile` prices for the same steps (the cost model's
    catch-up forward, 2 tokens after a fully accepted chain, then one token per further draft);
    None without a profile or drafting steps."""
    steps = records[records["drafted"].fillna(0) > 0] if "drafted" in records else records.iloc[:0]
    if profile is None or len(steps) < MIN_STEPS:
        return None
    full = float((steps["accepted"] == steps["drafted"]).mean())
    priced = profile.forward_s(1 + full, context) + (float(steps["drafted"].mean()) - 1) * profile.forward_s(1, context)
    return float(steps["draft_s"].mean()) / priced if priced > 0 else None


def retime(model, profile, widths, context: int, repeats: int) -> dict:
    """{width: time now / profiled time} for `model` (a loaded model, or a RemoteTarget: its worker
    re-times) at `context`, batch 1."""
    from specbench.record import profile_model, profile_worker

    widths = sorted(set(widths))
    if hasattr(model, "verify_begin"):
        now, _ = profile_worker(model.endpoint, tokens=widths, contexts=[context], repeats=repeats, batches=[1])
    else:
        now, _ = profile_model(model, tokens=widths, contexts=[context], repeats=repeats, progress=False)
    return {w: now.forward_s(w, context) / profile.forward_s(w, context) for w in widths
            if profile.forward_s(w, context) > 0}


@dataclass
class Calibrator:
    """The profiles of a tune, and what a target-only run measured now says about them.

    `target_factors` / `draft_factors`: per width, time now over profiled time (the target's anchored
    to the run's in-loop forward). `mode`: "speed" scales every target width by the run's 1-token forward
    over the profile's and each draft by its 1-token forward re-timed; "runs" (the default) starts so
    and then learns from each measured point's own steps (`learn`); "widths" re-times
    every target width after the run; "per-point" also re-times a point's widths just before it runs
    (`refresh`). On the 2-core box of 2026-11-26 the re-timed modes were the noisier ones (a few repeats
    of one width move 5-15% on a busy VM): benchmarks/results/2026-11-26-tune-calibration.md."""

    runner: object  # what runs the target: a loaded model, or a RemoteTarget
    target_profile: object
    drafts: dict  # candidate name -> loaded draft model (None: no model, e.g. prompt lookup)
    draft_profiles: dict
    context: int
    repeats: int
    overhead_s: float = 0.0
    mode: str = "runs"
    anchor: float = 1.0  # the in-loop 1-token forward over the re-timed one, both measured now
    target_factors: dict = field(default_factory=dict)
    draft_factors: dict = field(default_factory=dict)
    terms: dict = field(default_factory=dict)
    # mode "runs", one entry per run learned from: width -> run's median forward over the profile's, and
    # draft -> its run's drafting over what the profile prices; `runs` counts them, the target-only run first
    width_samples: dict = field(default_factory=dict)
    draft_samples: dict = field(default_factory=dict)
    runs: int = 0
    # and from runs of several clients through a worker (`learn_rounds`): batch -> a run's median round over
    # the profile's forward of that many rows; `batch_factors` their medians
    batch_samples: dict = field(default_factory=dict)
    batch_factors: dict = field(default_factory=dict)

    @classmethod
    def from_baseline(cls, baseline: pd.DataFrame, runner, target_profile, drafts: dict, draft_profiles: dict,
                      context: int, widths, repeats: int, mode: str = "runs") -> "Calibrator":
        """Calibrate from the target-only run `baseline` (just measured), re-timing what `mode` says."""
        from specbench.types import SpecbenchError

        if mode not in MODES:
            raise SpecbenchError(f"calibration mode {mode!r}: one of {MODES}")
        calibrator = cls(runner, target_profile, drafts, draft_profiles, context, repeats,
                         overhead_s=round(float(baseline["overhead_s"].median()), 5), mode=mode)
        in_loop = float(baseline["target_forward_s"].median())
        widths = sorted({1, *widths})
        profiled_one = target_profile.forward_s(1, context)
        if mode in ("speed", "runs"):
            speed = in_loop / profiled_one if profiled_one else 1.0
            calibrator.target_factors = {w: round(speed, 4) for w in widths}
        else:
            now = retime(runner, target_profile, widths, context, repeats)
            retimed_one = now.get(1, 1.0) * profiled_one
            calibrator.anchor = in_loop / retimed_one if retimed_one else 1.0
            calibrator.target_factors = {w: round(f * calibrator.anchor, 4) for w, f in now.items()}
        for name in drafts:
            draft_widths = (1,) if mode in ("speed", "runs") else DRAFT_WIDTHS
            calibrator.draft_factors[name] = calibrator._draft_now(name, {}, draft_widths)
        calibrator.terms = {
            "speed_factor": round(in_loop / profiled_one, 4) if profiled_one else 1.0,
            "width_factors": calibrator.target_factors, "anchor": round(calibrator.anchor, 4),
            "overhead_s": calibrator.overhead_s, "measured_forward_ms": round(1000 * in_loop, 2),
            "profiled_forward_ms": round(1000 * profiled_one, 2),
            "draft_speed_factors": {n: f.get(1) for n, f in calibrator.draft_factors.items()}, "mode": mode}
        calibrator.learn(None, baseline)
        return calibrator

    def learn(self, name: Optional[str], records: pd.DataFrame) -> None:
        """In mode "runs": the target's in-loop forward at each width and the draft `name`'s in-loop cost,
        from the steps of a point just measured (with every earlier one), priced into the points after it.
        Each width's factor is the median over runs of a run's median forward at it over the profile's
        (runs with under MIN_STEPS steps at a width, and widths the profile did not time, do not count
        there): one run's drift weighs no more than another's. In the other modes nothing changes."""
        if self.mode != "runs":
            return
        self.runs += 1
        measured = {row[0] for row in self.target_profile.rows_of(1)}
        for width, steps in records.groupby(records["drafted"].fillna(0).astype(int) + 1)["target_forward_s"]:
            profiled = self.target_profile.forward_s(int(width), self.context)
            # a width the profile never timed is priced by interpolation: a run's time there over it says how
            # far the interpolation is off (on the 2-core VM the Qwen 1.5B took 0.90 s for 3 tokens and 0.64 s
            # for 5, so 4 was priced 0.77 s and ran in 0.58), not how fast the timed widths around it run now
            if len(steps) >= MIN_STEPS and profiled > 0 and int(width) in measured:
                self.width_samples.setdefault(int(width), []).append(float(steps.median()) / profiled)
        self.target_factors = {w: round(statistics.median(f), 4) for w, f in sorted(self.width_samples.items())}
        drafted = draft_factor(self.draft_profiles.get(name), records, self.context)
        if drafted:
            self.draft_samples.setdefault(name, []).append(drafted)
            self.draft_factors[name] = {1: round(statistics.median(self.draft_samples[name]), 4)}
        self.terms.update(width_factors=self.target_factors, runs_learned=self.runs - 1,
                          draft_speed_factors={n: f.get(1) for n, f in self.draft_factors.items()})

    def learn_rounds(self, records: pd.DataFrame) -> None:
        """In mode "runs": the target's batched forward at each batch size, from the worker's rounds in a run of
        several clients (`worker_rounds`): a run's median round at B rows over what the profile prices for those
        rows (their mean width and context), a batch's factor the median over runs (batches with under MIN_STEPS
        rounds in a run do not count there). Why: the lone forward's factor does not carry over to rounds of
        several rows (on the 2-core VM of 2026-11-27, the Qwen 1.5B in bf16 ran its lone forwards 1.32x the
        profile's and its 8-row rounds 1.13x: scaled by the first, 8 clients were predicted 15-20% slow)."""
        if self.mode != "runs":
            return
        rounds = worker_rounds(records)
        for batch, found in rounds.groupby("rows"):
            if batch < 2 or len(found) < MIN_STEPS:
                continue
            priced = [self.target_profile.forward_s(w, round(c), int(batch))
                      for w, c in zip(found["width"], found["context"])]
            ratios = [seconds / price for seconds, price in zip(found["forward_s"], priced) if price > 0]
            if ratios:
                self.batch_samples.setdefault(int(batch), []).append(statistics.median(ratios))
        self.batch_factors = {b: round(statistics.median(f), 4) for b, f in sorted(self.batch_samples.items())}
        self.terms.update(batch_factors=self.batch_factors)

    def drafting(self, name: str, records: pd.DataFrame) -> None:
        """In mode "runs": the draft `name`'s cost from its drafter's own steps timed now (`replay.drafting_steps`),
        until a measured run of it teaches better (`learn`)."""
        factor = draft_factor(self.draft_profiles.get(name), records, self.context) if self.mode == "runs" else None
        if factor:
            self.draft_factors[name] = {1: round(factor, 4)}
            self.terms["draft_speed_factors"] = {n: f.get(1) for n, f in self.draft_factors.items()}
            self.terms.setdefault("drafting_timed", []).append(name)

    def _draft_now(self, name: str, default: dict, widths=DRAFT_WIDTHS) -> dict:
        from specbench.heads.profile import is_head

        model, profile = self.drafts.get(name), self.draft_profiles.get(name)
        if model is None or profile is None or is_head(model):  # a head is priced from its runs (`learn`) only
            return default
        return {w: round(f, 4) for w, f in retime(model, profile, widths, self.context, self.repeats).items()}

    def profiles(self, target_factors: Optional[dict] = None, draft_factors: Optional[dict] = None):
        """(the target's profile, {name: draft profile}) at these factors (default: the calibration's);
        a draft never re-timed takes the target's factors."""
        target_factors = target_factors or self.target_factors
        draft_factors = {**self.draft_factors, **(draft_factors or {})}
        drafts = {name: scaled(profile, draft_factors.get(name) or target_factors) if profile else None
                  for name, profile in self.draft_profiles.items()}
        return scaled(self.target_profile, target_factors, self.batch_factors), drafts

    def refresh(self, candidate: Optional[str], k: int):
        """In mode "per-point": the profiles re-timed now at the widths a point of `candidate` at `k` uses
        (the target's 1- and (1 + k)-token forwards, its draft's), just before that point runs; in the
        other modes None: the calibration's own profiles, already priced, hold."""
        if self.mode != "per-point":
            return None
        now = retime(self.runner, self.target_profile, {1, 1 + k}, self.context, self.repeats)
        target = {**self.target_factors, **{w: f * self.anchor for w, f in now.items()}}
        drafts = {candidate: self._draft_now(candidate, {})} if candidate in self.drafts else {}
        return self.profiles(target, {n: f for n, f in drafts.items() if f})
