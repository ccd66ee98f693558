"""`specbench tune`: from a target, candidate drafts, the user's prompts and where the target runs, to
a configuration checked against a real run.

The phases (each resumable, `tune/phases.py`): profile what is missing on this machine (and on the
worker), record acceptance on a calibration split of the prompts, predict every operating point,
calibrate the prediction with a target-only run measured now (machine speed drifts within hours: a
profile taken at another moment predicts another machine), measure the best predicted points and each
candidate's best on the held-back prompts, and report predicted against measured, before and after
calibration, with the reason a point missed. Phases run within `budget_minutes`; what did not fit is
said, not silently dropped.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd
from tqdm.auto import tqdm

from specbench.hardware import machine_of
from specbench.plan.costs import Power, Prices
from specbench.plan.explore import cost_column, operating_points, prediction_frame, recommend
import specbench.tune.phases as phases
from specbench.tune.calibrate import Calibrator
from specbench.tune.duel import choice_rows, settle
from specbench.tune.hybrid import beside_hybrid, hybrid_at_load
from specbench.tune.rows import measured_row
from specbench.tune.candidates import check_drafts, draft_model, head_label, resolve_candidates
from specbench.tune.share import (MeasuringShare, estimate_s, measuring_s, neighbour, one_client_run,
                                  sweep_points)
from specbench.tune.spec import FREE, TuneSpec, check_sampled_load, split_prompts
from specbench.types import SpecbenchError


@dataclass
class TuneResult:
    predicted: pd.DataFrame  # every operating point: calibrated and learned from the measured points (`tokens_per_s`),
    # at the calibration window (`window_tokens_per_s`) and from the profiles as they were (`raw_tokens_per_s`)
    measured: pd.DataFrame  # the measured points: predicted, calibrated and measured tokens/s, errors, flags
    chosen: dict  # the configuration written to `config_path`
    folder: Path
    config_path: Optional[Path] = None
    report_path: Optional[Path] = None
    calibration: dict = field(default_factory=dict)
    left_out: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)  # per phase
    measuring: dict = field(default_factory=dict)  # its share of a sweep's measuring time, the neighbours it measured
    calibrator: Optional[Calibrator] = field(default=None, repr=False)  # re-times a point now ("per-point")
    predict_now: Optional[object] = field(default=None, repr=False)  # profiles -> the prediction table
    side_by_side: Optional[pd.DataFrame] = None  # target-only and two close best points interleaved: what chose
    hybrid: Optional[pd.DataFrame] = None  # target-only, the best point and suffix decoding's hybrid with a draft


def tune(spec: TuneSpec, folder: Optional[str | Path] = None, progress: bool = True) -> TuneResult:
    """Run the tune `spec` describes, in `folder` (default: the user cache's outputs/tune/<target>);
    a rerun in the same folder skips every profile, reference and measurement already there."""
    from specbench.data_paths import user_folder
    from specbench.datasets import load_prompts

    spec.check()
    started, began, seconds, left_out = time.monotonic(), time.time(), {}, []
    deadline = started + spec.budget_minutes * 60
    folder = Path(folder or user_folder("outputs") / "tune" / spec.target.replace("/", "_"))
    rows = (load_prompts(spec.prompts, limit=spec.prompt_count, seed=spec.seed) if isinstance(spec.prompts, str)
            else [{"prompt": prompt} for prompt in spec.prompts[:spec.prompt_count]])
    if len(rows) < 2:
        raise SpecbenchError(f"prompt set {spec.prompts!r} gave {len(rows)} prompts: tune needs at least 2 "
                             f"(one to calibrate on, one held back)")
    check_drafts(spec)
    runner, target, rtt_ms = _targets(spec)
    candidates, notes = resolve_candidates(spec, target)
    left_out += notes
    check_sampled_load(spec, candidates)
    tokenizer = target.tokenizer
    prompts = [row["prompt"] for row in rows]
    calibration, held = split_prompts(prompts, spec.calibration_share)
    store = phases.Store(folder, machine=machine_of(runner))
    context = _context(tokenizer, calibration, spec.max_new_tokens)
    bar = tqdm(total=5, desc=f"tune {spec.target}: {len(candidates)} candidates, {len(prompts)} prompts",
               unit="phase", disable=not progress)

    def phase(name: str) -> None:
        seconds[name] = time.monotonic() - started - sum(seconds.values())
        bar.set_postfix_str(name)
        bar.update()

    target_grid = {"tokens": sorted({1, *(k + 1 for k in spec.chain_ks), *(b + 1 for b in spec.tree_budgets)}),
                   "contexts": [context], "batches": sorted(set(spec.clients)) if spec.endpoint else [1]}
    draft_grid = {"tokens": [1, 2, 4], "contexts": [context], "batches": [1]}
    target_profile = phases.profile(store, runner, target_grid, spec, progress)
    drafts = {c.name: draft_model(c, target, spec) for c in candidates}
    draft_profiles = {c.name: phases.profile(store, drafts[c.name], draft_grid, spec, progress, label=head_label(c))
                      if drafts[c.name] is not None else None for c in candidates}
    phase("profiles")
    dataset = (f"{Path(spec.prompts).stem if isinstance(spec.prompts, str) else 'prompts'}[{len(calibration)} calibration]"
               f"{spec.sampling_tag}")  # a sampled tune's acceptance is not a greedy one's
    references = {c.name: phases.reference(store, target, c, drafts[c.name], calibration, dataset, spec, progress)
                  for c in candidates}
    phase("references")
    points = lambda reference: operating_points(reference, spec.chain_ks, rtts_ms=(rtt_ms,), local=not spec.endpoint,  # noqa: E731
                                                remote=bool(spec.endpoint), clients=spec.clients,
                                                worker_side=False)  # a tune measures what it predicts: client-side drafts
    for name, reference in references.items():
        if not reference.has_chains and not reference.tree_accepts:
            left_out.append(f"{name}: no draft step on the calibration prompts (prompt lookup or suffix decoding "
                            f"found nothing to draft), so nothing to predict it from")
    raw = _predict(candidates, target_profile, draft_profiles, references, points, context, spec)
    phase("predictions")
    baseline = phases.measure(store, runner, candidates[0], "target-only", 0, held, None, spec, progress)
    calibrator = Calibrator.from_baseline(baseline, runner, target_profile, drafts, draft_profiles, context,
                                          target_grid["tokens"], spec.repeats, mode=spec.calibration)
    held_references = _held_back(references, candidates, drafts, held, baseline, tokenizer, spec.chain_ks, calibrator,
                                 replay=spec.sampling() is None)
    replayed = sorted(name for name in held_references if held_references[name] is not references[name])
    alone = {("target-only", "none", 0): baseline}  # one-client runs measured: their loaded points replay them
    stats = runner.stats() if spec.endpoint and max(spec.clients) > 1 else None  # the worker's batching, as it shows it

    def now(profiles):
        frame = _predict(candidates, *profiles, held_references, points, context, spec,
                         overhead_s=calibrator.overhead_s)
        if stats is None:
            return frame
        from specbench.tune.loaded import loaded_frame, worker_rules

        frame = loaded_frame(frame, held_references, profiles, baseline, worker_rules(profiles[0], stats), context,
                             calibrator.overhead_s, alone)
        frame["recommended"] = frame["label"] == recommend(frame, spec.cs, spec.objective)["label"]
        return frame

    predicted = now(calibrator.profiles())
    predicted["raw_tokens_per_s"] = raw["tokens_per_s"].values
    phase("calibration")
    measured = [measured_row("target-only", "target-only", 0, baseline, predicted, raw, spec, rtt_ms)]
    share = MeasuringShare(spec.measure_share, sum(estimate_s(r, len(held), spec)
                                                   for r in sweep_points(predicted, spec).to_dict("records")))

    def measure(row: dict, stored: bool = False) -> None:
        """`stored`: an earlier tune in this folder measured the point; read, it costs no time or share."""
        clients = int(row["clients"])
        estimate = 0.0 if stored else estimate_s(row, len(held), spec)
        if time.monotonic() + estimate > deadline:
            left_out.append(f"{row['label']}: not measured, ~{estimate:.0f} s would pass the {spec.budget_minutes:g}-minute "
                            f"budget")
            return
        candidate, method = _method(row, candidates)
        retimed = calibrator.refresh(candidate.name, int(row["k"]))  # "per-point": its widths, just before it runs
        if retimed is None and calibrator.mode == "runs":  # priced with what the points measured before it taught
            retimed = calibrator.profiles()
        at_run = now(retimed) if retimed is not None else None
        records = phases.measure(store, runner, candidate, method, int(row["k"]), held, drafts[candidate.name], spec,
                                 progress, clients=clients)
        if not stored:
            share.took(estimate, measuring_s(records, clients))
        measured.append(measured_row(candidate.name, method, int(row["k"]), records, predicted, raw, spec, rtt_ms,
                             label=row["label"], at_run=at_run, clients=clients))
        if clients == 1:
            calibrator.learn(candidate.name, records)
            alone[(row["candidate"], row["kind"], int(row["k"]))] = records
        else:  # a shared target's rounds of several rows teach its batch grid
            calibrator.learn_rounds(records)

    measuring_from, free = time.monotonic(), {c.name for c in candidates if c.method in FREE}
    done = lambda row: row["label"] in {m["label"] for m in measured}  # noqa: E731
    for row in _to_measure(predicted, spec, free=free):
        measure(row)
    for row in phases.stored_points(store, predicted, spec, held, lambda row: _method(row, candidates)):
        if not done(row):  # what an earlier tune here measured (at another cs, say) is chosen among too
            measure(row, stored=True)
    # then, while the share of a sweep's measuring time allows, the best measured point's neighbouring K:
    # the choice is made among measured points, and a neighbour the prediction ranked just below is often
    # as good (a model draft's neighbour at one client is also one more run the calibration learns from)
    listed, stopped = len(measured), "every neighbour of the measured points is measured"
    while (row := neighbour(predicted, pd.DataFrame(measured), spec, free)) is not None:
        if not share.allows(time.monotonic() - measuring_from, estimate_s(row, len(held), spec)):
            stopped = f"{row['label']} would pass the share"
            break
        before = len(measured)
        measure(row)
        if len(measured) == before:
            stopped = "the time budget"
            break
    spent = time.monotonic() - measuring_from
    measuring = {"share": spec.measure_share, "sweep_estimate_s": round(share.sweep_s(), 1), "spent_s": round(spent, 1),
                 "spent_share": round(spent / share.sweep_s(), 4) if share.sweep_s() > 0 else None,
                 "neighbours": [r["label"] for r in measured[listed:]], "stopped": stopped}
    phase("measurements")
    # every point priced with all the measured points taught (mode "runs"; the window's prices otherwise)
    predicted = now(calibrator.profiles()).assign(raw_tokens_per_s=raw["tokens_per_s"].values,
                                                  window_tokens_per_s=predicted["tokens_per_s"].values)
    bar.close()
    table = pd.DataFrame(measured)
    duel = settle(table, spec, candidates, drafts, store, runner, held, rtt_ms, deadline, progress, left_out)
    from specbench.tune.loaded import loaded_terms, replayed_load, worker_rules
    from specbench.tune.report import chosen_config, write_config, write_report

    hybrid = None
    if stats is None:
        hybrid = beside_hybrid(table, table if duel is None else duel, spec, candidates, drafts, store, runner, held,
                               rtt_ms, deadline, progress, left_out)
        choice = next(t for t in (hybrid, duel, table) if t is not None)
    else:  # several clients: the hybrid alone and at the heaviest load join the measured points
        price = lambda records, row, clients: replayed_load(  # noqa: E731
            records, row, clients, worker_rules(calibrator.profiles()[0], stats))
        found = hybrid_at_load(table, spec, candidates, drafts, store, runner, held, rtt_ms, deadline, progress,
                               left_out, price)
        table = table if found is None else pd.concat([table, found], ignore_index=True)
        choice = choice_rows(table, duel)
    chosen = chosen_config(choice, spec, candidates)
    chosen["machine"] = store.machine  # what `run --config` and `serve --config` compare theirs with

    result = TuneResult(predicted, table, chosen, folder, left_out=left_out, side_by_side=duel, hybrid=hybrid,
                        calibration=dict(calibrator.terms, acceptance_replayed=replayed,
                                         **loaded_terms(stats, calibrator)),
                        seconds={name: round(value, 1) for name, value in seconds.items()}, measuring=measuring,
                        calibrator=calibrator, predict_now=now)
    result.measuring["read_back"] = read_back_note(store, began)
    if result.measuring["read_back"]:
        warnings.warn(result.measuring["read_back"], stacklevel=2)
    result.config_path = write_config(folder / "tune.json", spec, chosen)
    result.report_path = write_report(folder / "report.html", spec, result)
    return result


def read_back_note(store: "phases.Store", began: float) -> Optional[str]:
    """What the choice read from earlier tunes in its folder rather than measured now, and when those ran; None
    when everything was measured by this tune. Why said: a rerun reads every point already measured there (a
    killed tune, another cs), and compares their speeds with runs taken now, minutes or days apart; a VM's
    speed moves 15-20% in minutes (`tune/duel.py`)."""
    earlier = sorted(at for at in store.read_back.values() if at < began)
    if not earlier:
        return None
    stamp = lambda at: time.strftime("%Y-%m-%d %H:%M", time.gmtime(at))  # noqa: E731
    span = stamp(earlier[0]) + ("" if stamp(earlier[-1]) == stamp(earlier[0]) else f" to {stamp(earlier[-1])}")
    return (f"tune: {len(earlier)} measured run(s) were read back from earlier tunes in {store.folder} (measured "
            f"{span} UTC), not measured now; to measure every point in one sitting, give the tune "
            f"a new folder (--out-dir, or tune(spec, folder))")


def _targets(spec: TuneSpec):
    """(what runs the steps, the target's weights here, the measured RTT in ms). Acceptance replays
    anywhere, so references are recorded with the target's weights here; a worker is only timed."""
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    if spec.endpoint is None:
        target = load_model(ModelSpec(spec.target, dtype=spec.dtype, kernels=spec.kernels))
        return target, target, 0.0
    from specbench.worker.client import RemoteTarget, WorkerUnavailableError

    try:
        RemoteTarget(spec.endpoint, timeout_s=10, retries=0)  # reachable, before the target loads for minutes
    except WorkerUnavailableError as error:
        raise SpecbenchError(f"worker {spec.endpoint} is unreachable ({error}): start it, or tune locally") from None
    target = load_model(ModelSpec(spec.target, dtype=spec.dtype))  # the worker loaded its own kernels
    # what measures: the target's tokenizer for text prompts; a slow target's long prompt may take its time
    remote = RemoteTarget(spec.endpoint, timeout_s=120, retries=0, tokenizer=target.tokenizer)
    rtts = []
    for _ in range(10):
        sent = time.perf_counter()
        remote.health()
        rtts.append(1000 * (time.perf_counter() - sent))
    return remote, target, round(statistics.median(rtts), 2)


def _context(tokenizer, prompts: list, max_new_tokens: int) -> int:
    """Where a step's context sits on average: a prompt's median length plus half the output."""
    lengths = [len(tokenizer.encode(p)) for p in prompts] if tokenizer is not None else [len(p) for p in prompts]
    return int(statistics.median(lengths) + max_new_tokens // 2)


def _predict(candidates, target_profile, draft_profiles, references, points, context, spec: TuneSpec,
             overhead_s: float = 0.0) -> pd.DataFrame:
    frames = []
    for index, candidate in enumerate(candidates):
        reference = references[candidate.name]
        frame = prediction_frame(target_profile, draft_profiles[candidate.name], reference, points(reference),
                                 Prices(), Power(), context, overhead_s=overhead_s, cost=spec.objective)
        if index:
            frame = frame[frame["kind"] != "none"]
        if frame.empty:
            continue
        frame = frame.assign(candidate=[("target-only" if kind == "none" else candidate.name) for kind in frame["kind"]])
        frame["label"] = frame["candidate"] + ": " + frame["label"]
        frames.append(frame)
    frame = pd.concat(frames, ignore_index=True)
    cs, objective = spec.cs, spec.objective
    best = recommend(frame, cs, objective)["label"]
    frame["recommended"] = frame["label"] == best
    return frame


def _held_back(references: dict, candidates, drafts: dict, held: list, baseline: pd.DataFrame, tokenizer,
               ks, calibrator: Optional[Calibrator] = None, replay: bool = True) -> dict:
    """Each candidate's reference with its chain acceptance replayed on the held-back prompts from the
    target-only run's outputs (`tune/replay.py`); the calibration reference where that cannot be done.
    A model draft with the target's tokenizer also has its drafting timed there, for `calibrator`.
    `replay` False (a sampled tune: a greedy replay of sampled outputs would count argmax agreement, not
    what the rule accepts): every candidate keeps its calibration reference, and drafting is still timed."""
    from specbench.api import encode_prompts
    from specbench.decode.drafters import PromptLookupDrafter
    from specbench.decode.suffix_drafter import SuffixDrafter, SuffixSettings
    from specbench.tune.replay import drafting_steps, held_back_reference
    from specbench.tune.spec import LOOKUP, SUFFIX

    fresh = {LOOKUP: PromptLookupDrafter, SUFFIX: lambda: SuffixDrafter(SuffixSettings(cache="drafter"))}

    if "emitted_tokens" not in baseline:
        return dict(references)
    outputs = [[token for tokens in steps.sort_values("step")["emitted_tokens"] for token in tokens]
               for _, steps in baseline.groupby("prompt_index", sort=True)]
    prompts_ids = encode_prompts(held, tokenizer)
    replayed = {}
    for candidate in candidates:
        reference, lookup = references[candidate.name], candidate.method in fresh
        if candidate.method == "eagle":  # a head drafts from the target's features: no teacher-forced replay here
            replayed[candidate.name] = reference
            continue
        found = held_back_reference(reference, prompts_ids, outputs, new_drafter=fresh.get(candidate.method),
                                    draft=None if lookup else drafts[candidate.name], ks=ks)
        replayed[candidate.name] = (found if replay else None) or reference
        if found is not None and not lookup and calibrator is not None and calibrator.mode == "runs":
            calibrator.drafting(candidate.name, drafting_steps(drafts[candidate.name], prompts_ids, outputs, max(ks)))
    return replayed


def _method(row: dict, candidates) -> tuple:
    """(the candidate, the method that runs it) for a predicted point; target-only runs with the first."""
    if row["kind"] == "none":
        return candidates[0], "target-only"
    candidate = next(c for c in candidates if c.name == row["candidate"])
    if row["kind"] == "chain":
        return candidate, candidate.method
    return candidate, {"prompt-lookup": "prompt-lookup-tree", "suffix": "suffix-tree",
                       "eagle": "eagle-tree"}.get(candidate.method, "tree")


def _to_measure(predicted: pd.DataFrame, spec: TuneSpec, free: Iterable[str] = ()) -> list[dict]:
    """The predicted best points and each candidate's best (by the cost knob J at `cs`: the objective the
    choice is made by), best first; through a worker, also a point at the heaviest load planned for, where
    queueing weighs most on the price (lighter loads are priced by the same simulation, and the
    recommendation is measured wherever it lands). A model draft's loaded point replays its one-client
    run's proposals, so that run comes first, listed (measured, reported and learned from like any other);
    the heaviest load's check is its best point among those needing no one-client run besides the listed
    ones (target-only, drafts in `free`, or a draft and K already listed at one client)."""
    from specbench.plan.predict import choose, knob_values

    column = cost_column(spec.objective)
    every = predicted.to_dict("records")
    rows = [r for r in every if r["kind"] != "none"]
    base = [r for r in every if r["kind"] == "none"]
    ranked, chosen = [], []
    pool = list(rows)
    while pool and len(ranked) < spec.measure_top:
        best = choose(base + pool, spec.cs, cost=column)
        if best["kind"] == "none":
            pool = []
            break
        ranked.append(best)
        pool = [r for r in pool if r["label"] != best["label"]]
    for name in dict.fromkeys(r["candidate"] for r in rows):
        own = [r for r in rows if r["candidate"] == name]
        values = knob_values(base + own, spec.cs, cost=column)[len(base):]  # target-only the reference
        best = own[values.index(min(values))]
        if best["label"] not in {r["label"] for r in ranked + chosen}:
            chosen.append(best)
    listed = ranked + chosen
    twin = lambda r: (r["candidate"], r["kind"], int(r["k"]))  # noqa: E731  the same draft and K, any load
    alone = {twin(r) for r in listed}  # a listed point at any load has its one-client run measured
    ready = lambda r: r["kind"] == "none" or r["candidate"] in free or twin(r) in alone  # noqa: E731
    heaviest = max((int(r["clients"]) for r in rows), default=1)
    if heaviest > 1:
        load = [r for r in base + rows if int(r["clients"]) == heaviest]
        best = choose([r for r in load if ready(r)] or load, spec.cs, cost=column)
        if best["label"] not in {r["label"] for r in listed}:
            listed.append(best)
    ordered = []
    for row in listed:  # a model draft's one-client run before its loaded point
        if int(row["clients"]) > 1 and row["kind"] != "none" and row["candidate"] not in free:
            first = one_client_run(every, row)
            if first is not None and first["label"] not in {r["label"] for r in ordered}:
                ordered.append(first)
        if row["label"] not in {r["label"] for r in ordered}:
            ordered.append(row)
    return ordered
