"""What a tune leaves behind: the chosen configuration as a file `specbench run --config` reads back,
its translation for vLLM and SGLang (untested: where the method exists there), and an HTML report with
the Pareto, the measured points over it and the error table."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Optional

import pandas as pd

from specbench.tune.spec import GOAL_ERROR, TuneSpec


def write_config(path: Path, spec: TuneSpec, chosen: dict) -> Path:
    document = {**chosen, "translations": translations(chosen)}
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def chosen_config(table: pd.DataFrame, spec: TuneSpec, candidates) -> dict:
    """The measured point of `table` with the lowest cost knob J at `cs` (target-only's speed and cost the
    reference), as the configuration `specbench run --config` and `serve --config` read back; a hybrid's budget for
    its draft (`other_k`) and its knobs travel as suffix decoding's settings."""
    from specbench.plan.explore import cost_column
    from specbench.plan.predict import choose
    from specbench.tune.hybrid import hybrid_suffix
    from specbench.tune.share import as_points

    best = choose(as_points(table), spec.cs, cost=cost_column(spec.objective))
    candidate = next((c for c in candidates if c.name == best["candidate"]), None)
    other_k = best.get("other_k")
    return {"target": spec.target, "endpoint": spec.endpoint, "method": best["method"], "k": int(best["k"]),
            "draft": candidate.draft if candidate else None,
            "self_draft_layers": candidate.self_draft_layers if candidate else None,
            "substitute_quantization": candidate.quantization if candidate and candidate.method == "substitute" else None,
            "suffix": hybrid_suffix(other_k) if other_k is not None and pd.notna(other_k) else None,
            "dtype": spec.dtype, "kernels": spec.kernels, "max_new_tokens": spec.max_new_tokens,
            "temperature": float(spec.temperature), "rule": spec.verify_rule,
            "objective": spec.objective, "cs": spec.cs,
            "label": best["label"], "measured_tokens_per_s": round(best["measured_tokens_per_s"], 3),
            "clients": int(best.get("clients", 1))}  # the load it was measured under


def read_config(path: str | Path) -> dict:
    """A tune's configuration; refused by name when it is not one."""
    from specbench.types import SpecbenchError

    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise SpecbenchError(f"cannot read the tune configuration {path}: {error}") from None
    if not isinstance(document, dict):
        raise SpecbenchError(f"{path} is not a tune configuration: it holds a {type(document).__name__}, not an object")
    missing = {"target", "method", "k"} - set(document)
    if missing:
        raise SpecbenchError(f"{path} is not a tune configuration: it lacks {sorted(missing)}")
    from specbench.models.spec import KERNELS
    from specbench.types import VERIFY_RULES

    checks = {"target": lambda v: isinstance(v, str) and v, "method": lambda v: isinstance(v, str) and v,
              "k": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,  # 0: target-only chosen
              "draft": lambda v: v is None or isinstance(v, str),
              "self_draft_layers": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
              "substitute_quantization": lambda v: v is None or isinstance(v, str),
              "dtype": lambda v: isinstance(v, str), "kernels": lambda v: v in KERNELS,
              "temperature": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6,
              "rule": lambda v: v in VERIFY_RULES, "suffix": lambda v: v is None or isinstance(v, dict)}
    wrong = [f"{name}={document[name]!r}" for name, good in checks.items()
             if name in document and not good(document[name])]
    if wrong:  # an edited file: named here, not a TypeError deep in the run it configures
        raise SpecbenchError(f"{path}: {', '.join(wrong)} (target, method: names; k an integer >= 0; "
                             f"self_draft_layers >= 1; kernels: one of {KERNELS}; temperature >= 0; "
                             f"rule: one of {VERIFY_RULES}; suffix: an object of SuffixSettings' fields)")
    if document.get("suffix"):
        from specbench.decode.suffix_drafter import suffix_options

        try:
            suffix_options(suffix_words(document))
        except SpecbenchError as error:
            raise SpecbenchError(f"{path}: suffix {document['suffix']}: {error}") from None
    return document


def suffix_words(config: dict) -> list[str]:
    """A configuration's suffix decoding settings as `--suffix` takes them (`other_k=4`); none: []."""
    return [f"{name}={value}" for name, value in (config.get("suffix") or {}).items()]


def length_note(measured: Optional[int], asked: int) -> Optional[str]:
    """Why a tune's choice, measured on replies of up to `measured` tokens (the configuration's `max_new_tokens`),
    may not hold for `asked`-token ones (`types.reply_length_note`); what `run --config` prints and `serve --config`
    tells each such request."""
    from specbench.types import reply_length_note

    return reply_length_note(measured, asked, "the tune's choice was measured",
                             f"tune at this length (`specbench tune --max-new-tokens {asked}`)")


def machine_note(measured_on: Optional[str], here: str) -> Optional[str]:
    """Why a tune's choice measured on `measured_on` may not hold on `here` (`types.machine_note`); what `run
    --config` and `serve --config` print."""
    from specbench.types import machine_note as note

    return note(measured_on, here, "the tune's choice was measured", "tune on this machine to check it (`specbench tune`)")


def translations(chosen: dict) -> dict:
    """vLLM's `speculative_config` and SGLang's flags for the same choice where those engines have the
    method; untested here (neither engine runs on these machines), so marked as such."""
    method, k = chosen["method"], chosen["k"]
    vllm: Optional[dict] = None
    sglang: Optional[list] = None
    if method in ("chain", "eagle") and chosen.get("draft"):  # a head is written in EAGLE-3's published layout
        vllm = {**({"method": "eagle3"} if method == "eagle" else {}), "model": chosen["draft"],
                "num_speculative_tokens": k}
        sglang = ["--speculative-algorithm", "EAGLE3" if method == "eagle" else "STANDALONE",
                  "--speculative-draft-model-path", chosen["draft"], "--speculative-num-steps", str(k),
                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(k + 1)]
    elif method in ("prompt-lookup", "prompt-lookup-tree"):
        vllm = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        sglang = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k + 1)]
    elif method == "suffix":  # vLLM's suffix decoding (Arctic Inference's), our SuffixSettings' defaults
        vllm = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": 24,
                "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
    reason = None if vllm else f"{method!r} has no equivalent in vLLM or SGLang (target-only needs no speculative config)"
    return {"note": "untested translations: written from the engines' documentation, not run here",
            "vllm_speculative_config": vllm, "sglang_flags": sglang, "no_equivalent": reason}


def write_report(path: Path, spec: TuneSpec, result) -> Path:
    from specbench.plan.explore import cost_column
    from specbench.viz.report import write_pareto_report

    column = cost_column(spec.objective)
    measured = result.measured.rename(columns={"measured_tokens_per_s": "tokens_per_s"})
    hybrid = getattr(result, "hybrid", None)
    if hybrid is not None:  # measured, not predicted: drawn among the measured points, where the choice may be
        ran = hybrid[hybrid["other_k"].notna()].rename(columns={"measured_tokens_per_s": "tokens_per_s"})
        measured = pd.concat([measured, ran[["label", "tokens_per_s", column]]], ignore_index=True)
    predicted = result.predicted.assign(variant=result.predicted["candidate"])
    mode = result.calibration.get("mode", "speed")
    learned = result.calibration.get("runs_learned", 0)
    retimed = {"speed": "", "widths": ", every forward width re-timed then",
               "per-point": ", every forward width re-timed then and each measured point's widths again just before "
                            "it ran",
               "runs": f", then each measured point's in-loop forwards and drafting pricing the points after it "
                       f"({learned} learned from)"}[mode]
    widths = ", ".join(f"{w} tokens {f:.3g}x" for w, f in (result.calibration.get("width_factors") or {}).items())
    note = (f"Calibration (a target-only run measured in the same window as the held-back runs{retimed}): this "
            f"machine ran the target's 1-token forward {result.calibration.get('speed_factor', 1):g}x the profile's "
            f"time{f' (per width: {widths})' if widths and mode != 'speed' else ''}, "
            f"{1000 * result.calibration.get('overhead_s', 0):.1f} ms of loop per step. Chosen: "
            f"{result.chosen['label']} at cs={spec.cs:g} ({spec.objective}).")
    sampling = spec.sampling()
    if sampling is not None:
        note += (f" Sampled at temperature {sampling.temperature:g}, verified by {sampling.rule}: acceptance recorded "
                 f"and every point measured so (seed {spec.seed}); held-back acceptance is the calibration split's, "
                 f"not replayed from target-only's outputs.")
    interleaved = {"side_by_side": "The best measured point and the next best one run could hold beside it were "
                                   "close, so they ran side by side with target-only",
                   "hybrid": "Suffix decoding with the best measured draft (a hybrid: each step suffix decoding where "
                             "its counts vouch, else the draft; the planner does not predict it) ran beside the best "
                             "point and target-only"}
    for name, what in interleaved.items():
        run = getattr(result, name, None)
        if run is not None:
            speeds = ", ".join(f"{row.label} {row.measured_tokens_per_s:.3g}" for row in run.itertuples())
            note += (f" {what}, every held-back prompt through each in turn, and the choice was made on that run "
                     f"(tok/s: {speeds}).")
    at_load = result.measured[result.measured["other_k"].notna()] if "other_k" in result.measured else []
    if len(at_load):
        note += (f" Suffix decoding with the best measured draft (a hybrid: {at_load['label'].iloc[0]}) ran alone, "
                 f"its drafts recorded, then at {int(at_load['clients'].max())} clients replaying them; that load's "
                 f"prediction replays the lone run's own steps against the worker, the lone run has none.")
    loaded = result.calibration.get("loaded")
    if loaded:
        note += (f" Points at several clients: {loaded['priced']} (a round waits {loaded['window_ms']:g} ms, and up to "
                 f"{loaded['wait_cap_ms']:g} ms for a session expected back; host work {loaded['host_fixed_ms']:g} ms "
                 f"+ {loaded['host_row_ms']:g} ms a row), trees excepted.")
        batches = ", ".join(f"{b} rows {f:.3g}x" for b, f in (result.calibration.get("batch_factors") or {}).items())
        if batches:
            note += f" The worker's rounds of a loaded run ran its batch grid at: {batches}."
    page = write_pareto_report(path, [{"title": f"tune {spec.target}", "predicted": predicted,
                                       "measured": measured[["label", "tokens_per_s", column]], "cs": spec.cs}],
                               cost=spec.objective, note=note)
    errors = result.measured[["label", "measured_tokens_per_s", "predicted_tokens_per_s", "window_tokens_per_s",
                              "calibrated_tokens_per_s", "error_before", "error_window", "error_after", "flag",
                              *(["replay_misses"] if "replay_misses" in result.measured else [])]]
    extra = (f"<h2>Predicted vs measured (held-back prompts)</h2><p>Goal: |error| <= {GOAL_ERROR:.0%} after "
             f"calibration. Median |error| before {_median(result.measured['error_before']):.1%}, at the "
             f"calibration window {_median(result.measured['error_window']):.1%}, after "
             f"{_median(result.measured['error_after']):.1%}.</p>"
             + errors.to_html(index=False, float_format=lambda v: f"{v:.4g}")
             + _measuring(result.measuring)
             + "<h2>Left out</h2><ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in result.left_out)
             + "</ul><h2>Time per phase (s)</h2>" + pd.DataFrame([result.seconds]).to_html(index=False))
    text = page.read_text()
    page.write_text(text.replace("</body>", extra + "</body>"))
    return page


def _measuring(measuring: dict) -> str:
    """What the measuring cost against an exhaustive sweep, and what the share left measured around the best."""
    if not measuring:
        return ""
    spent = f" ({measuring['spent_share']:.1%})" if measuring.get("spent_share") is not None else ""
    around = ", ".join(measuring["neighbours"]) or "none"
    return "<p>" + html.escape(f"Measuring took {measuring['spent_s']:g} s{spent} of an exhaustive sweep's estimated "
                               f"{measuring['sweep_estimate_s']:g} s (share allowed {measuring['share']:.0%}); "
                               f"neighbours of the best measured points measured within it: {around}; stopped: "
                               f"{measuring['stopped']}.") + "</p>" + (
        f"<p><b>{html.escape(measuring['read_back'])}</b></p>" if measuring.get("read_back") else "")


def _median(values: pd.Series) -> float:
    return float(values.abs().median()) if len(values) else float("nan")
