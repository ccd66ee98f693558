"""`specbench tune` end to end on tiny models (seconds), resumed after a kill, and bad inputs refused by
name before any work."""
import json
import signal
import subprocess
import sys
import time

import pytest

from specbench.plan.predict import LatencyProfile
from specbench.tune import TuneSpec, tune
from specbench.types import SpecbenchError

DRAFT = "tiny-random:seed=1,noise=0.005,noise_from=0"
SHARED_PROFILE = LatencyProfile("t", "cpu", rows=((1, 256, 0.10, 1), (5, 256, 0.15, 1)))
PROMPTS = tuple([(i * 7 + j * 3) % 90 + 3 for j in range(12)] for i in range(8))


def spec(**overrides) -> TuneSpec:
    settings = dict(target="tiny-random:seed=0", drafts=(DRAFT, "prompt-lookup", "self-draft:2"), prompts=PROMPTS,
                    prompt_count=6, chain_ks=(1, 2, 4), max_new_tokens=12, budget_minutes=5, repeats=2)
    settings.update(overrides)
    return TuneSpec(**settings)


def test_tune_end_to_end_chooses_a_measured_point_and_writes_what_run_reads(tmp_path):
    from specbench.tune.report import read_config

    result = tune(spec(), tmp_path, progress=False)
    measured = result.measured
    assert measured.iloc[0]["method"] == "target-only" and len(measured) >= 3
    assert {"error_before", "error_window", "error_after", "flag"} <= set(measured.columns)
    assert result.calibration["mode"] == "runs" and result.calibration["runs_learned"] == len(measured) - 1
    assert 1 in result.calibration["width_factors"]  # from the target-only run, before any point
    assert {"window_tokens_per_s", "raw_tokens_per_s"} <= set(result.predicted.columns)
    speed = tune(spec(calibration="speed"), tmp_path / "speed", progress=False)
    assert set(speed.calibration["width_factors"]) == {1, 2, 3, 5}  # every verify width priced
    assert len(set(speed.calibration["width_factors"].values())) == 1  # "speed": one factor
    retimed = tune(spec(calibration="per-point"), tmp_path / "per-point", progress=False)
    assert all(factor > 0 for factor in retimed.calibration["width_factors"].values())
    assert retimed.calibration["mode"] == "per-point" and "error_window" in retimed.measured
    assert (measured["measured_tokens_per_s"] > 0).all() and (measured["predicted_tokens_per_s"] > 0).all()
    assert result.calibration["speed_factor"] > 0 and result.seconds["measurements"] >= 0
    chose_from = measured if result.side_by_side is None else result.side_by_side  # close best two: run side by side
    best = chose_from.loc[chose_from["label"] == result.chosen["label"]].iloc[0]
    assert result.chosen["measured_tokens_per_s"] == pytest.approx(best["measured_tokens_per_s"], rel=1e-3)
    config = read_config(result.config_path)
    assert config["translations"]["note"].startswith("untested")
    from specbench.hardware import machine_label

    assert config["machine"] == machine_label()  # what run --config and serve --config compare theirs with
    assert "Predicted vs measured" in result.report_path.read_text()
    # tiny random prompts repeat no 4-token run, but prompt lookup's partial matches are priced at their widths
    assert (result.predicted["candidate"] == "prompt-lookup").any() and not result.left_out
    assert result.measuring["sweep_estimate_s"] > 0 and "Measuring took" in result.report_path.read_text()
    assert tune(spec(measure_share=0.0), tmp_path / "none", progress=False).measuring["neighbours"] == []
    from specbench.cli import build_parser
    from specbench.tune.command import apply_config

    args = build_parser().parse_args(["run", "--config", str(result.config_path)])
    apply_config(args)
    assert (args.target, args.method[-1], args.k) == ("tiny-random:seed=0", config["method"], config["k"])
    assert args.draft == config["draft"] and args.self_draft_layers == config["self_draft_layers"]


def test_a_tune_on_tuned_kernels_profiles_them_and_its_choice_runs_on_them(tmp_path):
    """The target and a model draft load with the kernels asked for, a substitute with its own; the profiles
    carry the kernels' label, the configuration names them and `run --config` loads them."""
    from specbench.cli import build_parser
    from specbench.tune.command import apply_config

    result = tune(spec(drafts=(DRAFT, "substitute:int8-dynamic"), kernels="tuned"), tmp_path, progress=False)
    assert result.chosen["kernels"] == "tuned"
    profiled = {path.name for path in (tmp_path / "profiles").glob("*.json")}
    assert any("tuned" in name for name in profiled), profiled
    args = build_parser().parse_args(["run", "--config", str(result.config_path)])
    apply_config(args)
    assert args.kernels == "tuned"


def test_a_choice_measured_through_a_worker_runs_through_it(tmp_path, capsys):
    """`run --config` and `serve --config` of a tune made through a worker ran the target on this machine (a model
    the tune never ran here); now they go to the worker the configuration names (`run` says so); `--worker` names
    another."""
    from specbench.cli import build_parser
    from specbench.tune.command import apply_config

    path = tmp_path / "tune.json"
    base = {"target": "tiny-random:seed=0", "method": "chain", "k": 2, "draft": DRAFT}
    path.write_text(json.dumps({**base, "endpoint": "tcp://127.0.0.1:5599"}))
    args = build_parser().parse_args(["run", "--config", str(path)])
    apply_config(args)
    assert args.worker == "tcp://127.0.0.1:5599" and "tcp://127.0.0.1:5599" in capsys.readouterr().out
    args = build_parser().parse_args(["run", "--config", str(path), "--worker", "tcp://127.0.0.1:6000"])
    apply_config(args)
    assert args.worker == "tcp://127.0.0.1:6000"
    from specbench.serve.command import settings_from

    assert settings_from(build_parser().parse_args(["serve", "--config", str(path)])).worker == "tcp://127.0.0.1:5599"
    assert settings_from(build_parser().parse_args(["serve", "--config", str(path), "--worker",
                                                    "tcp://127.0.0.1:6000"])).worker == "tcp://127.0.0.1:6000"
    path.write_text(json.dumps({**base, "endpoint": None}))  # measured locally: runs locally
    args = build_parser().parse_args(["run", "--config", str(path)])
    apply_config(args)
    assert args.worker is None


def test_run_and_serve_config_say_when_the_tune_measured_on_another_machine(tmp_path, capsys):
    """A tune's choice carried to another machine (a laptop's tune served on a GPU box, a CPU without AVX-512):
    a draft's cost against the target's moves with the machine, so the choice was not checked there. `run
    --config` and `serve --config` say so; on the same machine, or from a file that does not say, nothing."""
    from specbench.cli import build_parser
    from specbench.hardware import machine_label
    from specbench.serve.command import settings_from
    from specbench.tune.command import apply_config
    from specbench.tune.report import machine_note

    here = machine_label()
    path = tmp_path / "tune.json"
    base = {"target": "tiny-random:seed=0", "method": "chain", "k": 2, "draft": DRAFT}
    for machine, said in ((None, False), (here, False), ("cpu-2t-Other-CPU", True),
                          (f"{here} -> worker NVIDIA-H100-80GB-HBM3", False),  # this side is this machine
                          ("cpu-2t-Other-CPU -> worker NVIDIA-H100-80GB-HBM3", True)):
        path.write_text(json.dumps({**base, **({"machine": machine} if machine else {})}))
        apply_config(build_parser().parse_args(["run", "--config", str(path)]))
        settings_from(build_parser().parse_args(["serve", "--config", str(path), "--worker", "tcp://127.0.0.1:6000"]))
        out = capsys.readouterr().out
        assert out.count(f"was measured on {machine}, and this machine is {here}") == (2 if said else 0), (machine, out)
    assert machine_note("cpu-2t-Other-CPU", here).endswith("tune on this machine to check it (`specbench tune`)")
    assert machine_note(here, f"{here} + NVIDIA-H100-80GB-HBM3") is not None  # a CPU tune served on a GPU here


def test_run_config_says_when_its_replies_are_far_longer_than_the_tunes(tmp_path, capsys):
    """A tune measured on 32-token replies, run at 256: what each method drafts changes along a reply, so `run
    --config` says the choice was checked only for replies like the tune's; at 48 tokens, or with no length
    recorded, it says nothing."""
    from specbench.cli import build_parser
    from specbench.tune.command import apply_config

    path = tmp_path / "tune.json"
    base = {"target": "tiny-random:seed=0", "method": "chain", "k": 2, "draft": DRAFT}
    for recorded, asked, said in ((32, 256, True), (32, 48, False), (None, 256, False)):
        path.write_text(json.dumps({**base, "max_new_tokens": recorded}))
        apply_config(build_parser().parse_args(["run", "--config", str(path), "--max-new-tokens", str(asked)]))
        out = capsys.readouterr().out
        assert ("The tune's choice was measured on replies of up to 32 tokens and now serves 256-token ones" in out
                and "--max-new-tokens 256" in out) == said, out


def test_with_the_share_unspent_the_tune_measures_every_neighbour_after_its_list(tmp_path, monkeypatch):
    """A tiny model's runs take milliseconds, the tune's own bookkeeping more: no share covers its wall time, so
    the share is taken as never spent here; the neighbours then come after the listed points, each once, until
    none is left."""
    from specbench.tune.share import MeasuringShare

    monkeypatch.setattr(MeasuringShare, "allows", lambda self, spent_s, estimate_s: True)
    every = tune(spec(), tmp_path, progress=False)
    neighbours = every.measuring["neighbours"]
    assert neighbours and every.measured["label"].tolist()[-len(neighbours):] == neighbours
    assert every.measured["label"].is_unique and every.measuring["stopped"].startswith("every neighbour")


def test_a_rerun_resumes_and_a_killed_tune_resumes_where_it_stopped(tmp_path):
    """Killed once its profiles and references are written, the tune's rerun in the same folder records
    neither again (their files are untouched) and finishes."""
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from tests_tune_spec import spec; "
            f"from specbench.tune import tune; tune(spec(), {str(tmp_path / 'tune')!r}, progress=False)")
    (tmp_path / "tests_tune_spec.py").write_text(
        "from specbench.tune import TuneSpec\n"
        f"def spec():\n    return TuneSpec(target='tiny-random:seed=0', drafts=({DRAFT!r}, 'self-draft:2'), "
        f"prompts={PROMPTS!r}, prompt_count=6, chain_ks=(1, 2, 4), max_new_tokens=48, budget_minutes=5, repeats=2)\n")
    process = subprocess.Popen([sys.executable, "-c", code])
    measured = tmp_path / "tune" / "measured"
    deadline = time.time() + 120
    while time.time() < deadline and not (measured.exists() and any(measured.glob("*.json"))):
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = {path: path.stat().st_mtime_ns for folder in ("profiles", "reference")
               for path in (tmp_path / "tune" / folder).glob("*.json")}
    assert len([p for p in written if "profile-" in p.name]) == 3 and any("reference-" in p.name for p in written)
    started = time.perf_counter()
    import importlib.util

    loader = importlib.util.spec_from_file_location("tests_tune_spec", tmp_path / "tests_tune_spec.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    result = tune(module.spec(), tmp_path / "tune", progress=False)
    assert {path: path.stat().st_mtime_ns for path in written} == written  # nothing profiled or recorded again
    assert len(result.measured) >= 2 and time.perf_counter() - started < 120


@pytest.mark.parametrize("overrides,message", [
    (dict(drafts=("no-such-model-anywhere",)), "unknown draft 'no-such-model-anywhere'"),
    (dict(budget_minutes=0.5), "leaves no time"),
    (dict(prompts=()), "gave 0 prompts"),
    (dict(endpoint="tcp://127.0.0.1:9"), "unreachable"),
    (dict(clients=(1, 4)), "give a worker endpoint"),
    (dict(objective="speed"), "unknown objective 'speed'"),
    (dict(drafts=("eagle:/no/such/head",)), "draft head '/no/such/head': not a folder holding a head"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),  # before: profiled for minutes first
], ids=["unknown-draft", "budget-too-small", "no-prompts", "unreachable-worker", "clients-without-worker",
        "unknown-objective", "not-a-head", "no-tokens"])
def test_bad_inputs_are_refused_by_name_before_any_work(tmp_path, overrides, message):
    started = time.perf_counter()
    with pytest.raises(SpecbenchError, match=message):
        tune(spec(**overrides), tmp_path, progress=False)
    assert time.perf_counter() - started < 20
    assert not list((tmp_path).rglob("profile-*.json")), "work started before the refusal"


def test_a_draft_head_is_a_candidate_profiled_recorded_predicted_and_measured_like_any_draft(tmp_path):
    """`eagle:<folder>`: the head's own forward profiled, its eagle chains recorded as `eagle:<folder name>`,
    its points predicted from them and its best measured with method eagle (greedy: the target's outputs);
    the chosen config and its EAGLE-3 translation name the folder."""
    from specbench.heads.build import new_head
    from specbench.heads.layouts import save_head
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.tune.report import translations

    folder = save_head(new_head(load_model(ModelSpec("tiny-random:seed=0")), seed=3), tmp_path / "my-head")
    name = f"eagle:{folder}"
    result = tune(spec(drafts=(name, "prompt-lookup")), tmp_path / "tune", progress=False)
    eagle = result.predicted[result.predicted["candidate"] == name]
    assert sorted(eagle["k"]) == [1, 2, 4] and set(eagle["method"]) == {"eagle"}
    measured = result.measured[result.measured["candidate"] == name]
    assert len(measured) >= 1 and set(measured["method"]) == {"eagle"} and (measured["measured_tokens_per_s"] > 0).all()
    assert measured["steps"].min() > 0 and result.calibration["runs_learned"] == len(result.measured) - 1
    assert list((tmp_path / "tune" / "profiles").glob("*eagle*my-head*.json"))
    assert list((tmp_path / "tune" / "reference").glob("*eagle*my-head*.json"))
    translated = translations({"method": "eagle", "k": 4, "draft": str(folder)})
    assert translated["vllm_speculative_config"] == {"method": "eagle3", "model": str(folder),
                                                     "num_speculative_tokens": 4}


def test_a_dataset_file_with_no_prompts_is_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecbenchError, match="no prompts"):
        tune(spec(prompts=str(empty)), tmp_path / "out", progress=False)


@pytest.mark.parametrize("draft", ["model", "int8-dynamic", "prompt-lookup"])
def test_acceptance_replayed_from_target_only_outputs_is_what_sd_accepts(tiny_target, tiny_draft, draft):
    """`tune/replay.py`: greedy SD emits the target's tokens, so each full chain step's accepted count follows
    from the target-only output alone: a teacher-forced draft forward (or prompt lookup over the context, or
    a quantized draft's own drafter fed as SD feeds it) gives exactly the counts a real SD run records,
    step for step."""
    from specbench.api import outputs, run
    from specbench.decode.drafters import ModelDrafter, PromptLookupDrafter
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.tune.replay import chain_steps, drafter_proposer, model_proposer

    prompts, k = [list(p) for p in PROMPTS[:4]] + [[5, 6, 7, 5, 6, 7, 5, 6]], 4
    model = load_model(ModelSpec(DRAFT, quantization=draft)) if draft == "int8-dynamic" else tiny_draft
    alone = outputs(run(tiny_target, prompts, method="target-only", max_new_tokens=24, progress=False))
    method = "prompt-lookup" if draft == "prompt-lookup" else "chain"
    sd = run(tiny_target, prompts, method=method, draft=None if draft == "prompt-lookup" else model, k=k,
             max_new_tokens=24, progress=False, warmup=False)
    replayed, recorded = [], []
    own = PromptLookupDrafter() if draft == "prompt-lookup" else ModelDrafter(model, model.vocab_size)
    for index, prompt in enumerate(prompts):
        full = prompt + alone[("target-only", index)]
        propose = model_proposer(full, model) if draft == "model" else drafter_proposer(full, own)
        replayed += [accepted for _, drafted, accepted in chain_steps(full, len(prompt), propose, k) if drafted == k]
        steps = sd[(sd["prompt_index"] == index) & (sd["drafted"] == k)]
        recorded += steps["accepted"].tolist()
    assert len(recorded) >= 8 and replayed == recorded
    assert 0 < sum(recorded) < k * len(recorded)  # both outcomes occur: the comparison can fail
    if draft == "prompt-lookup":  # the share of steps that found a full chain, replayed and recorded alike
        from specbench.record import _hits

        steps = [step for index, prompt in enumerate(prompts) for step in chain_steps(
            prompt + alone[("target-only", index)], len(prompt),
            drafter_proposer(prompt + alone[("target-only", index)], PromptLookupDrafter()), k)]
        hit = sum(drafted == k for budget, drafted, _ in steps if budget == k) / sum(b == k for b, _, _ in steps)
        assert 0 < hit < 1 and _hits(sd, k, 24, lookup=True) == {k: round(hit, 4)}
        # every step, partial matches and capped last steps included, replayed and recorded alike (steps_at_k)
        from specbench.record import _run_steps

        pairs = [(drafted, accepted) for _, drafted, accepted in steps]
        assert any(0 < drafted < k for drafted, _ in pairs)  # partial matches occur: the check can fail
        assert _run_steps(sd, k, lookup=True)["steps_at_k"] == {k: tuple(pairs)}
    # every step of the run at each K, each output's capped last steps included (`steps_at_k`): what a tune
    # prices a point's tokens per step and verify widths from, so its tokens per step are the run's exactly
    from specbench.plan.predict import AcceptanceReference, OperatingPoint, predict_step
    from specbench.tune.replay import held_back_reference

    seed = AcceptanceReference("prompt-lookup" if draft == "prompt-lookup" else "d", "t", "x", max_chain=k,
                               chain_accepts=(1,))
    found = held_back_reference(seed, prompts, [alone[("target-only", i)] for i in range(len(prompts))],
                                new_drafter=PromptLookupDrafter if draft == "prompt-lookup" else None,
                                draft=None if draft == "prompt-lookup" else model, ks=(2, k))
    for size in (2, k) if draft != "int8-dynamic" else (k,):  # a quantized draft is replayed at its K only
        ran = sd if size == k else run(tiny_target, prompts, method=method, k=size, max_new_tokens=24,
                                       draft=None if draft == "prompt-lookup" else model, progress=False,
                                       warmup=False)
        assert found.steps_at_k[size] == tuple(zip(ran["drafted"], ran["accepted"]))
        assert any(d < size for d, _ in found.steps_at_k[size])  # capped or partial steps: the check can fail
        point = predict_step(OperatingPoint(method, k=size), SHARED_PROFILE, None if draft == "prompt-lookup"
                             else SHARED_PROFILE, found)
        assert point.tokens_per_step == pytest.approx(float(ran["emitted"].mean()))


def test_suffix_decodings_steps_replayed_from_target_only_outputs_are_what_sd_drafts_and_accepts(tiny_target, tmp_path):
    """Suffix decoding as a tune candidate: one drafter per K fed the held-back prompts in order, its cache
    taking each output as a run's does, drafts and accepts at every step what a real SD run of it records
    (its steps of every length, `steps_at_k`), and the tune prices and measures it as a candidate."""
    from specbench.api import outputs, run
    from specbench.decode.suffix_drafter import SuffixDrafter, SuffixSettings
    from specbench.plan.predict import AcceptanceReference
    from specbench.record import _run_steps
    from specbench.tune.replay import held_back_reference

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], *[list(p) for p in PROMPTS[:3]], [5, 6, 7, 5, 6, 7, 5, 6]]
    alone = outputs(run(tiny_target, prompts, method="target-only", max_new_tokens=24, progress=False))
    seed = AcceptanceReference("suffix", "t", "d", max_chain=4, steps_at_k={4: ((1, 1),)})
    replayed = held_back_reference(seed, prompts, [alone[("target-only", i)] for i in range(len(prompts))],
                                   new_drafter=lambda: SuffixDrafter(SuffixSettings(cache="drafter")), ks=(2, 4))
    for k in (2, 4):
        sd = run(tiny_target, prompts, method="suffix", k=k, max_new_tokens=24, progress=False, warmup=False,
                 suffix=SuffixSettings(cache="drafter"))
        assert replayed.steps_at_k[k] == _run_steps(sd, k, lookup=True)["steps_at_k"][k]
        drafted = [d for d, _ in replayed.steps_at_k[k]]
        assert 0 in drafted and max(drafted) == k  # steps with nothing to draft and full ones: it can fail
    assert any(0 < d < 4 for d, _ in replayed.steps_at_k[4])  # partial drafts, priced at their widths
    result = tune(spec(drafts=("suffix",), prompts=tuple(prompts) * 2, prompt_count=10), tmp_path, progress=False)
    assert (result.predicted["candidate"] == "suffix").any() and (result.measured["method"] == "suffix").any()


def test_width_factors_scale_each_forward_by_its_own_drift():
    """A profile scaled by per-width factors: each row by its width's factor, linear between re-timed
    widths, the nearest one's beyond them; the forward time at any width follows."""
    from specbench.plan.predict import LatencyProfile
    from specbench.tune.calibrate import factor_at, scaled

    factors = {1: 0.8, 5: 0.9}
    assert factor_at(factors, 1) == 0.8 and factor_at(factors, 3) == pytest.approx(0.85)
    assert factor_at(factors, 8) == 0.9 and factor_at(factors, 0) == 0.8
    profile = LatencyProfile(model="m", device="cpu", dtype="float32", quantization="none", weight_bytes=1,
                             kv_bytes_per_token=1, rows=((1, 64, 0.100, 1), (3, 64, 0.120, 1), (5, 64, 0.150, 1),
                                                         (5, 64, 0.300, 2)))
    now = scaled(profile, factors)
    assert now.forward_s(1, 64) == pytest.approx(0.080) and now.forward_s(3, 64) == pytest.approx(0.102)
    assert now.forward_s(5, 64) == pytest.approx(0.135) and now.forward_s(5, 64, 2) == pytest.approx(0.270)


def test_calibration_reads_the_runs_in_loop_forward_and_retimes_every_width(monkeypatch):
    """The anchor carries the in-loop 1-token forward over the re-timed one to every width; a refresh
    re-times the point's widths and keeps the calibration's other ones; a draft with no model takes
    the target's factors."""
    import pandas as pd

    import specbench.tune.calibrate as calibrate
    from specbench.plan.predict import LatencyProfile

    profile = LatencyProfile(model="t", device="cpu", dtype="float32", quantization="none", weight_bytes=1,
                             kv_bytes_per_token=1, rows=((1, 64, 0.100, 1), (5, 64, 0.200, 1)))
    timed = {"now": {1: 0.9, 5: 0.7}}
    monkeypatch.setattr(calibrate, "retime", lambda model, prof, widths, context, repeats: {
        w: timed["now"][w] for w in widths})
    baseline = pd.DataFrame({"target_forward_s": [0.099, 0.099], "overhead_s": [0.002, 0.002]})
    calibrator = calibrate.Calibrator.from_baseline(baseline, object(), profile, {"lookup": None}, {"lookup": None},
                                                    context=64, widths=[5], repeats=1, mode="per-point")
    assert calibrator.anchor == pytest.approx(0.099 / 0.090)
    assert calibrator.target_factors == pytest.approx({1: 0.99, 5: 0.77})
    target, drafts = calibrator.profiles()
    assert target.forward_s(5, 64) == pytest.approx(0.154) and drafts == {"lookup": None}
    timed["now"] = {1: 0.9, 5: 0.9}
    target, _ = calibrator.refresh("lookup", 4)
    assert target.forward_s(5, 64) == pytest.approx(0.200 * 0.9 * 0.099 / 0.090)


def test_runs_teach_each_width_and_each_draft_its_in_loop_cost():
    """Mode "runs": a measured point's steps give the target's forward at each width it verified (a width
    with under MIN_STEPS steps in a run does not count) and its draft's cost against what the profile
    prices for the same steps; widths never run, or never profiled, interpolate; mode "speed" learns nothing."""
    import pandas as pd

    from specbench.plan.predict import LatencyProfile
    from specbench.tune.calibrate import MIN_STEPS, Calibrator, factor_at

    def profile(name, rows):
        return LatencyProfile(model=name, device="cpu", dtype="float32", quantization="none", weight_bytes=1,
                              kv_bytes_per_token=1, rows=rows)

    target = profile("t", ((1, 64, 0.100, 1), (5, 64, 0.200, 1)))
    draft = profile("d", ((1, 64, 0.010, 1), (2, 64, 0.020, 1)))
    baseline = pd.DataFrame({"target_forward_s": [0.09] * 20, "overhead_s": [0.001] * 20, "drafted": [0] * 20})
    for mode in ("runs", "speed"):
        calibrator = Calibrator.from_baseline(baseline, object(), target, {"d": None}, {"d": draft}, context=64,
                                              widths=[5], repeats=1, mode=mode)
        assert calibrator.target_factors[1] == pytest.approx(0.9)
        chain = pd.DataFrame({"drafted": [4] * 20 + [2] * (MIN_STEPS - 1), "accepted": [0] * 20 + [2] * (MIN_STEPS - 1),
                              "target_forward_s": [0.3] * 20 + [9.0] * (MIN_STEPS - 1),
                              "draft_s": [0.08] * 20 + [0.06] * (MIN_STEPS - 1)})
        calibrator.learn("d", chain)
        if mode == "speed":
            assert calibrator.target_factors == {1: 0.9, 5: 0.9} and not calibrator.draft_factors.get("d")
            continue
        assert calibrator.target_factors == pytest.approx({1: 0.9, 5: 1.5})  # width 3's few steps left out
        assert factor_at(calibrator.target_factors, 3) == pytest.approx(1.2)
        # drafting priced 0.01 (catch-up) + 3 x 0.01 on 20 steps, 0.01 + 0.01 on 9 of which 9 fully accepted
        steps_s = 20 * 0.08 + 9 * 0.06
        priced = draft.forward_s(1 + 9 / 29, 64) + ((20 * 4 + 9 * 2) / 29 - 1) * 0.01
        assert calibrator.draft_factors["d"][1] == pytest.approx(steps_s / 29 / priced, rel=1e-3)
        target_now, drafts_now = calibrator.profiles()
        assert target_now.forward_s(5, 64) == pytest.approx(0.3) and calibrator.terms["runs_learned"] == 1
        # a width the profile never timed (4: interpolated) teaches nothing, however many steps ran there
        calibrator.learn(None, pd.DataFrame({"drafted": [3] * 20, "accepted": [0] * 20,
                                             "target_forward_s": [0.01] * 20, "draft_s": [0.0] * 20}))
        assert calibrator.target_factors == pytest.approx({1: 0.9, 5: 1.5})
        assert drafts_now["d"].forward_s(1, 64) == pytest.approx(0.010 * calibrator.draft_factors["d"][1])


def test_a_loaded_runs_rounds_teach_the_batch_grid_between_the_lone_factor_and_the_learned_batches():
    """Mode "runs": a run of several clients gives the worker's rounds (rows sharing a forward time and batch size;
    a group short of its batch size dropped), each priced at its rows' mean width and context; a batch's factor
    scales the grid's rows of that batch, batches between 1 and it interpolate from the lone width factor, and a
    batch with under MIN_STEPS rounds teaches nothing."""
    import pandas as pd

    from specbench.tune.calibrate import MIN_STEPS, Calibrator, worker_rounds

    target = LatencyProfile(model="t", device="cpu", dtype="float32", quantization="none", weight_bytes=1,
                            kv_bytes_per_token=1, rows=((1, 64, 0.100, 1), (3, 64, 0.100, 1), (1, 64, 0.150, 4),
                                                        (3, 64, 0.250, 4), (1, 64, 0.200, 8), (3, 64, 0.300, 8)))
    rows = []
    for step in range(MIN_STEPS):  # 4 rows a round, two clients at width 1 and two at width 3: priced 0.200
        for client in range(4):
            rows.append(dict(client=client, prompt_index=client, step=step, drafted=2 * (client % 2), emitted=1,
                             prompt_tokens=40, batch_size=4, target_forward_s=0.24 + step / 1000))
    for step in range(MIN_STEPS - 1):  # rounds of 8 too few to count
        rows += [dict(client=c, prompt_index=c, step=100 + step, drafted=0, emitted=1, prompt_tokens=40, batch_size=8,
                      target_forward_s=9.0 + step) for c in range(8)]
    rows.append(dict(client=0, prompt_index=0, step=200, drafted=0, emitted=1, prompt_tokens=40, batch_size=2,
                     target_forward_s=5.0))  # its round's other row belongs to another run
    records = pd.DataFrame(rows)
    rounds = worker_rounds(records)
    assert sorted(rounds["rows"].value_counts().items()) == [(4, MIN_STEPS), (8, MIN_STEPS - 1)]
    four = rounds[rounds["rows"] == 4]
    assert four["width"].eq(2.0).all() and four["context"].between(40, 40 + MIN_STEPS).all()
    baseline = pd.DataFrame({"target_forward_s": [0.12] * 20, "overhead_s": [0.0] * 20, "drafted": [0] * 20})
    for mode in ("runs", "speed"):
        calibrator = Calibrator.from_baseline(baseline, object(), target, {}, {}, context=64, widths=[3], repeats=1,
                                              mode=mode)
        calibrator.learn_rounds(records)
        now, _ = calibrator.profiles()
        if mode == "speed":  # the lone factor scales every batch
            assert calibrator.batch_factors == {} and now.forward_s(1, 64, 4) == pytest.approx(0.150 * 1.2)
            continue
        factor = (0.24 + (MIN_STEPS - 1) / 2000) / 0.200  # the median round over its price
        assert calibrator.batch_factors == pytest.approx({4: factor}, rel=1e-3)
        assert now.forward_s(3, 64, 4) == pytest.approx(0.250 * factor, rel=1e-3)
        assert now.forward_s(1, 64, 8) == pytest.approx(0.200 * factor, rel=1e-3)  # beyond: the nearest learned
        assert now.forward_s(1, 64) == pytest.approx(0.120)  # the lone forward keeps its own factor
        assert calibrator.terms["batch_factors"] == calibrator.batch_factors


def test_a_tune_through_a_worker_measures_each_client_count_with_its_clients_at_once(tmp_path):
    """With a worker endpoint and clients (1, 2), the heaviest load planned for is measured: the 2-client point runs
    two clients together (each its own connection; the worker's batches of 2 show in the records), priced at
    that load (per-client tokens/s, the target's cost split), and only 1-client runs teach the calibration's widths
    (the loaded run's rounds, found in its records, its batch grid);
    greedy outputs through the clients at once equal the prompts decoded alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from worker_helpers import ThreadWorker

    from specbench.api import outputs
    from specbench.tune import phases

    worker = ThreadWorker(batch_wait_ms="50")
    try:
        result = tune(spec(endpoint=worker.endpoint, clients=(1, 2), drafts=(DRAFT, "prompt-lookup")), tmp_path,
                      progress=False)
        measured = result.measured
        assert set(measured["clients"]) == {1, 2}, measured[["label", "clients"]]
        two = measured[measured["clients"] == 2].iloc[0]
        assert "2 clients" in two["label"] and two["measured_tokens_per_s"] > 0
        assert result.calibration["runs_learned"] == int((measured["clients"] == 1).sum()) - 1
        assert "batch_factors" in result.calibration  # the loaded run's rounds were learned from
        # the loaded chain and target-only points are priced by simulating two clients against the worker
        loaded = result.predicted[(result.predicted["clients"] == 2) & (result.predicted["kind"] != "tree")]
        assert len(loaded) and loaded["simulated"].eq(True).all(), loaded[["label", "simulated"]]
        assert result.calibration["loaded"]["wait_cap_ms"] >= 0 and "several clients" in result.report_path.read_text()
        held = [list(p) for p in PROMPTS[3:6]]
        job = dict(method="prompt-lookup", draft=None, k=2, max_new_tokens=12, self_draft_layers=None,
                   substitute_quantization="8bit", dtype="float32", seed=0, warmup=False)
        together = phases.together(worker.endpoint, 2, held, job, progress=False)
        assert sorted(together["client"].unique()) == [0, 1] and together["batch_size"].max() == 2
        from specbench.tune.calibrate import worker_rounds

        rounds = worker_rounds(together)
        assert (rounds["rows"] == 2).any() and rounds["rows"].sum() == len(together), rounds
        # each reply names its batch: rows of one number share one forward time, and differ from the next's
        shared = together.groupby("batch_round")["target_forward_s"].nunique()
        assert (together["batch_round"] > 0).all() and (shared == 1).all()
        unnumbered = together.assign(batch_round=-1)  # records of an older worker: grouped by forward time
        assert worker_rounds(unnumbered)["rows"].sum() <= len(together)
        from specbench.api import run
        from specbench.worker.client import RemoteTarget

        alone = outputs(run(RemoteTarget(worker.endpoint), held, **job, progress=False))
        both = outputs(together[together["client"] == 0]) | outputs(together[together["client"] == 1])
        assert both == alone
    finally:
        worker.stop()


def test_a_model_draft_under_load_replays_what_it_drafted_alone(tmp_path, monkeypatch):
    """Through a worker, a model draft's one-client point records its proposals; at two clients each client
    replays them (the draft model is never called: the users' drafts run on their own devices) and decodes
    step for step as the draft did alone, with its outputs the target's; a point measured before proposals
    were kept is measured again at one client rather than replayed from nothing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from worker_helpers import ThreadWorker

    from specbench.decode.drafters import ModelDrafter
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.tune import phases
    from specbench.tune.spec import candidate
    from specbench.worker.client import RemoteTarget

    worker = ThreadWorker(batch_wait_ms="50")
    try:
        tuned, store = spec(endpoint=worker.endpoint, clients=(1, 2)), phases.Store(tmp_path)
        draft, chosen = load_model(ModelSpec(DRAFT)), candidate(DRAFT)
        held = [list(p) for p in PROMPTS[3:6]]
        remote = RemoteTarget(worker.endpoint)
        alone = phases.measure(store, remote, chosen, "chain", 2, held, draft, tuned, False)
        key = phases.point_key(tuned, chosen, "chain", 2, held)
        assert (tmp_path / "measured" / f"{key}.proposals.json").exists()
        monkeypatch.setattr(ModelDrafter, "propose", lambda *a, **k: pytest.fail("a replaying client drafted"))
        both = phases.measure(store, remote, chosen, "chain", 2, held, draft, tuned, False, clients=2)
        assert (both["replay_misses"] == 0).all() and both["batch_size"].max() == 2
        steps = lambda frame, i: frame.loc[frame["prompt_index"] == i, ["drafted", "accepted"]].values.tolist()  # noqa
        for index in range(len(held)):
            ran = both[(both["prompt_index"] == index)]
            first = ran[ran["client"] == ran["client"].min()]
            assert steps(first, index) == steps(alone, index), index
        monkeypatch.undo()
        (tmp_path / "measured" / f"{key}.proposals.json").unlink()  # as if measured before proposals were kept
        again = phases.measure(store, remote, chosen, "chain", 2, held, draft, tuned, False)
        assert (tmp_path / "measured" / f"{key}.proposals.json").exists() and len(again) == len(alone)
    finally:
        worker.stop()


def test_a_head_under_load_replays_with_its_features_sent_as_alone(tmp_path):
    """A client-side head reads the target's features: replayed at two clients, each client is bound as the head
    was alone, so the worker sends the features every step (the bytes a real client-side head costs), and the
    steps are the head's own."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from worker_helpers import ThreadWorker

    from specbench.heads.build import new_head
    from specbench.heads.layouts import save_head
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.tune import phases
    from specbench.tune.spec import candidate
    from specbench.worker.client import RemoteTarget

    folder = save_head(new_head(load_model(ModelSpec("tiny-random:seed=0")), seed=3), tmp_path / "head",
                       embeddings=True)  # a client-side head brings its own embeddings
    worker = ThreadWorker(batch_wait_ms="50")
    try:
        tuned, store = spec(endpoint=worker.endpoint, clients=(1, 2)), phases.Store(tmp_path / "tune")
        head, held = candidate(f"eagle:{folder}"), [list(p) for p in PROMPTS[3:6]]
        remote = RemoteTarget(worker.endpoint)
        alone = phases.measure(store, remote, head, "eagle", 2, held, None, tuned, False)
        both = phases.measure(store, remote, head, "eagle", 2, held, None, tuned, False, clients=2)
        assert (both["replay_misses"] == 0).all() and both["batch_size"].max() == 2
        assert alone["bytes_down"].mean() > 100  # feature rows come back with every verify
        assert both["bytes_down"].mean() == pytest.approx(alone["bytes_down"].mean(), rel=0.2)
    finally:
        worker.stop()


def test_a_loaded_row_counts_its_replay_misses_and_names_them_when_it_missed():
    """Steps a replaying client drafted itself (its request parted from the lone run at a near-tie) are counted per
    loaded point, and named as the reason where they are over a tenth of its steps and the point missed."""
    import pandas as pd

    from specbench.tune.rows import measured_row

    records = pd.DataFrame({"emitted": [3] * 10, "draft_s": 0.1, "verify_s": 0.2, "network_s": 0.0, "overhead_s": 0.0,
                            "bytes_up": 0.0, "bytes_down": 0.0, "kind": "chain", "planned": False, "step_s": 0.3,
                            "batch_size": 2, "target_forward_s": 0.2, "queue_s": 0.0, "prompt_index": 0,
                            "client": [0] * 5 + [1] * 5, "replay_misses": [3] * 5 + [0] * 5})
    predicted = pd.DataFrame([{"label": "d K=2 x2", "tokens_per_s": 20.0, "tokens_per_step": 3.0,
                               "total_cost_usd_per_mtok": 1.0}])
    tuned = spec(endpoint="tcp://127.0.0.1:1", clients=(1, 2))
    row = measured_row("d", "chain", 2, records, predicted, predicted, tuned, 0.0, label="d K=2 x2", clients=2)
    assert row["replay_misses"] == 3 and row["flag"].startswith("replay: 3 of 10 steps")
    row = measured_row("d", "chain", 2, records.assign(replay_misses=0), predicted, predicted, tuned, 0.0,
                       label="d K=2 x2", clients=2)
    assert row["replay_misses"] == 0 and not row["flag"].startswith("replay")


def test_a_drafts_first_point_is_priced_from_its_own_drafting_timed_now(tiny_target, tiny_draft):
    """`replay.drafting_steps` runs the draft's drafter over the target's outputs, the steps SD takes (the
    same accepted counts as SD records), timed; `Calibrator.drafting` prices the draft from them in mode
    "runs" only, against what its profile prices for the same steps."""
    import pandas as pd

    from specbench.api import outputs, run
    from specbench.plan.predict import LatencyProfile
    from specbench.tune.calibrate import Calibrator, draft_factor
    from specbench.tune.replay import drafting_steps

    prompts = [list(p) for p in PROMPTS[:4]]
    alone = outputs(run(tiny_target, prompts, method="target-only", max_new_tokens=24, progress=False))
    steps = drafting_steps(tiny_draft, prompts, [alone[("target-only", i)] for i in range(4)], 4, min_steps=12)
    sd = run(tiny_target, prompts, method="chain", draft=tiny_draft, k=4, max_new_tokens=24, progress=False,
             warmup=False)
    assert len(steps) >= 12 and (steps["draft_s"] > 0).all()
    walked = sd[sd["drafted"] > 0].head(len(steps))
    assert steps["accepted"].tolist() == walked["accepted"].tolist()
    profile = LatencyProfile(model="d", device="cpu", dtype="float32", quantization="none", weight_bytes=1,
                             kv_bytes_per_token=1, rows=((1, 64, 1e-4, 1), (2, 64, 2e-4, 1)))
    baseline = pd.DataFrame({"target_forward_s": [0.09] * 20, "overhead_s": [0.001] * 20, "drafted": [0] * 20})
    for mode in ("runs", "speed"):
        calibrator = Calibrator.from_baseline(baseline, object(), profile, {"d": None}, {"d": profile}, context=64,
                                              widths=[5], repeats=1, mode=mode)
        calibrator.drafting("d", steps)
        expected = {1: round(draft_factor(profile, steps, 64), 4)} if mode == "runs" else {}
        assert calibrator.draft_factors["d"] == expected


def test_through_a_worker_only_the_heaviest_load_is_checked_besides_the_best_points():
    """Clients (1, 2, 4, 8): the tune measures the two best points by J, each candidate's fastest, and the best
    point at 8 clients; the best points at 2 and 4 clients are not measured (the simulation prices them)."""
    import pandas as pd

    from specbench.tune.run import _to_measure

    rows = [dict(label="target-only", candidate="target-only", kind="none", k=0, clients=1, tokens_per_s=10.0,
                 total_cost_usd_per_mtok=1.0)]
    for clients in (1, 2, 4, 8):
        for name, speed in (("d", 20.0), ("lookup", 15.0)):
            for k in (2, 4):
                rows.append(dict(label=f"{name} K={k} x{clients}", candidate=name, kind="chain", k=k, clients=clients,
                                 tokens_per_s=(speed + k) / clients ** 0.5, total_cost_usd_per_mtok=1.0))
    picked = [r["label"] for r in _to_measure(pd.DataFrame(rows), spec(cs=0.0, measure_top=2))]
    assert picked[:3] == ["d K=4 x1", "d K=2 x1", "lookup K=4 x1"]
    assert picked[3:] == ["d K=4 x8"] and not any(" x2" in p or " x4" in p for p in picked)


def test_each_candidates_best_is_its_best_by_the_objective_not_its_fastest():
    """At cs 0.5 a candidate's best point is the one with the lowest J: prompt lookup at K=2 (a little slower
    than K=4, at half the cost) is measured, not K=4; at cs 0 (speed alone) K=4 is."""
    import pandas as pd

    from specbench.tune.run import _to_measure

    rows = [dict(label="target-only", candidate="target-only", kind="none", k=0, clients=1, tokens_per_s=10.0,
                 total_cost_usd_per_mtok=1.0),
            dict(label="d K=4", candidate="d", kind="chain", k=4, clients=1, tokens_per_s=30.0,
                 total_cost_usd_per_mtok=0.2),
            dict(label="lookup K=2", candidate="lookup", kind="chain", k=2, clients=1, tokens_per_s=17.0,
                 total_cost_usd_per_mtok=0.5),
            dict(label="lookup K=4", candidate="lookup", kind="chain", k=4, clients=1, tokens_per_s=19.0,
                 total_cost_usd_per_mtok=1.0)]
    assert [r["label"] for r in _to_measure(pd.DataFrame(rows), spec(cs=0.5, measure_top=1))] == ["d K=4", "lookup K=2"]
    assert [r["label"] for r in _to_measure(pd.DataFrame(rows), spec(cs=0.0, measure_top=1))] == ["d K=4", "lookup K=4"]


def test_a_loaded_model_draft_point_comes_after_its_one_client_run_and_the_heavy_check_needs_none_more():
    """Through a worker a model draft's loaded point replays its one-client run: the tune lists that run first
    (measured and reported, not done silently), and checks the heaviest load with its best point among those
    needing no one-client run besides the listed ones (here the draft's K=4, not the unlisted K=2)."""
    import pandas as pd

    from specbench.tune.run import _to_measure

    def point(name, kind, k, clients, speed):
        label = f"{name} K={k} x{clients}"
        return dict(label=label, candidate=name, kind=kind, k=k, clients=clients, tokens_per_s=speed,
                    total_cost_usd_per_mtok=1.0)

    speeds = {("d", 2): {1: 20, 2: 12, 8: 9}, ("d", 4): {1: 25, 2: 14, 8: 8}, ("lookup", 2): {1: 15, 2: 9, 8: 6}}
    rows = [point("target-only", "none", 0, c, s) for c, s in ((1, 10), (2, 7), (8, 4))]
    rows += [point(n, "chain", k, c, s) for (n, k), by in speeds.items() for c, s in by.items()]
    listed = lambda: [r["label"] for r in _to_measure(pd.DataFrame(rows), spec(cs=0.0, measure_top=1,  # noqa: E731
                                                                               endpoint="tcp://127.0.0.1:1",
                                                                               clients=(1, 2, 8)), free={"lookup"})]
    assert listed() == ["d K=4 x1", "lookup K=2 x1", "d K=4 x8"]  # d K=2 x8 is faster but would need d K=2 x1
    rows[[r["label"] for r in rows].index("d K=2 x2")]["tokens_per_s"] = 40  # now the best point of all
    assert listed() == ["d K=2 x1", "d K=2 x2", "lookup K=2 x1", "d K=2 x8"]


def test_the_share_left_measures_the_best_measured_points_neighbouring_k_then_the_next_bests():
    """Around the best measured point by J: its draft's neighbouring K at the same load (the better predicted
    first), a model draft's one-client run before its loaded neighbour, then the next best's neighbours; none
    once every neighbour is measured, and target-only has no K to look around."""
    import pandas as pd

    from specbench.tune.share import neighbour

    def point(name, k, clients, speed):
        return dict(label=f"{name} K={k} x{clients}", candidate=name, kind="none" if name == "target-only" else "chain",
                    k=k, clients=clients, tokens_per_s=speed, total_cost_usd_per_mtok=1.0)

    predicted = pd.DataFrame([point("target-only", 0, 1, 10), point("target-only", 0, 2, 8)]
                             + [point(n, k, c, 10 + k + (n == "d")) for n in ("d", "lookup") for k in (2, 4, 6)
                                for c in (1, 2)])

    def measured(*points):
        return pd.DataFrame([dict(label=f"{n} K={k} x{c}", candidate=n, method="target-only" if n == "target-only"
                                  else "chain", k=k, clients=c, measured_tokens_per_s=s, total_cost_usd_per_mtok=1.0)
                             for n, k, c, s in points])

    cases = spec(cs=0.0, chain_ks=(2, 4, 6), endpoint="tcp://127.0.0.1:1", clients=(1, 2))
    first = measured(("target-only", 0, 1, 10), ("d", 4, 1, 20), ("lookup", 2, 1, 15))
    assert neighbour(predicted, first, cases, free={"lookup"})["label"] == "d K=6 x1"  # predicted faster than K=2
    both = measured(("target-only", 0, 1, 10), ("d", 4, 1, 20), ("d", 6, 1, 18), ("d", 2, 1, 17))
    assert neighbour(predicted, both, cases, free={"lookup"}) is None  # the best's neighbours measured; K=6 and
    # K=2's neighbours too (K=4): nothing left around the drafting points
    loaded = measured(("target-only", 0, 1, 10), ("d", 4, 2, 30), ("d", 4, 1, 20), ("d", 2, 1, 16), ("d", 6, 1, 17))
    assert neighbour(predicted, loaded, cases, free={"lookup"})["label"] == "d K=6 x2"  # its one-client run is there
    alone = measured(("target-only", 0, 1, 10), ("d", 4, 2, 30), ("d", 4, 1, 20))
    assert neighbour(predicted, alone, cases, free={"lookup"})["label"] == "d K=6 x1"  # the replayed run first
    lookup = measured(("target-only", 0, 1, 10), ("lookup", 4, 2, 30))
    assert neighbour(predicted, lookup, cases, free={"lookup"})["label"] == "lookup K=6 x2"  # drafts live: no run first
    slow = measured(("target-only", 0, 1, 30), ("d", 4, 1, 20))
    assert neighbour(predicted, slow, cases, free={"lookup"})["label"] == "d K=6 x1"  # target-only skipped, not an end


def test_the_measuring_share_scales_the_sweeps_estimate_by_what_measured_points_took():
    from specbench.tune.share import MeasuringShare

    share = MeasuringShare(0.2, estimated_s=1000)
    assert share.sweep_s() == 1000 and share.allows(150, 50) and not share.allows(150, 51)
    share.took(estimate_s=100, taken_s=150)  # the points took 1.5x their estimates: so would the sweep's
    assert share.sweep_s() == 1500 and share.allows(200, 66) and not share.allows(200, 67)
    assert not MeasuringShare(0.0, 1000).allows(0, 1)


@pytest.mark.parametrize("bad", ['[{"tokens": 1', '{"tokens": 3}', "", "null", "[]", "[1, 2]"])
def test_a_damaged_measurement_in_the_tune_folder_is_named_and_measured_again(tmp_path, capsys, bad):
    """An outside tester's edited `measured/*.json`: before, pandas' ValueError ("Unexpected character",
    "If using all scalar values") came out of the tune, or `null` read as an empty frame of no records."""
    import pandas as pd

    from specbench.tune.phases import Store

    store = Store(tmp_path)
    records = pd.DataFrame([{"method": "chain", "k": 2, "tokens": 5, "step_s": 0.25}])
    store.save_measured("point", records)
    pd.testing.assert_frame_equal(store.measured("point"), records)
    (tmp_path / "measured" / "point.json").write_text(bad)
    assert store.measured("point") is None
    assert "point.json is unreadable" in capsys.readouterr().err


def test_a_stored_measurement_reads_back_as_it_was_timed(tmp_path):
    """pandas writes 10 decimals unless told: a millisecond step read back 1e-8 off, and a rerun's hybrid speeds,
    read from the stored side-by-side run, differed from the first tune's in memory by 1.6e-9 (a CI failure)."""
    import pandas as pd

    from specbench.tune.phases import Store

    records = pd.DataFrame([{"method": "chain", "k": 2, "tokens": 5, "step_s": 0.00123456789012345},
                            {"method": "chain", "k": 2, "tokens": 3, "step_s": 1 / 3 * 1e-3}])
    store = Store(tmp_path, machine="here")
    store.save_measured("point", records)
    back = store.measured("point")["step_s"].tolist()
    assert back == pytest.approx(records["step_s"].tolist(), rel=1e-13)


def test_a_measurement_taken_on_another_machine_is_measured_again_not_read(tmp_path, capsys):
    """A tune folder in a home shared by machines (or a user cache carried to another CPU): its points were read
    back as if this machine had measured them, and chosen among runs timed here."""
    import pandas as pd

    from specbench.tune.phases import Store

    records = pd.DataFrame([{"method": "chain", "k": 2, "tokens": 5, "step_s": 0.25}])
    Store(tmp_path, machine="cpu-2t-AMD-EPYC-avx512bf16").save_measured("point", records)
    mine = Store(tmp_path, machine="cpu-2t-AMD-EPYC-avx512bf16")
    pd.testing.assert_frame_equal(mine.measured("point"), records)
    assert mine.holds("point") and list(mine.read_back) == ["point"]
    other = Store(tmp_path, machine="cpu-2t-Intel-Xeon")
    assert not other.holds("point") and other.measured("point") is None
    assert "taken on cpu-2t-AMD-EPYC-avx512bf16, not this machine (cpu-2t-Intel-Xeon)" in capsys.readouterr().err
    other.save_measured("point", records.assign(step_s=0.5))  # measured again here: now this machine's
    assert other.measured("point")["step_s"].tolist() == [0.5] and not mine.holds("point")
    (tmp_path / "measured" / "before.json").write_text(records.to_json(orient="records"))  # before machines were kept
    assert other.holds("before") and other.measured("before") is not None


def test_a_rerun_says_which_runs_it_read_back_from_earlier_tunes(tmp_path):
    """A rerun in a tune's folder chooses among the points an earlier tune measured there (a killed tune, another
    cs) without measuring them again; it now says so, with when they were measured, in a warning and the report."""
    import warnings

    from specbench.hardware import device_name

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = tune(spec(measure_share=0.0), tmp_path, progress=False)
    # a first tune in a fresh folder reads nothing back, and says nothing of it (a busy box may warn of its profiles)
    assert first.measuring["read_back"] is None and not [w for w in caught if "read back" in str(w.message)]
    index = json.loads((tmp_path / "measured" / "machines.json").read_text())
    assert {entry["machine"] for entry in index.values()} == {device_name("cpu")}
    with pytest.warns(UserWarning, match=r"tune: \d+ measured run\(s\) were read back from earlier tunes in .* "
                                         r"\(measured 20\d\d-\d\d-\d\d \d\d:\d\d"):
        again = tune(spec(measure_share=0.0), tmp_path, progress=False)
    read = int(again.measuring["read_back"].split()[1])
    assert read == len(first.measured) + (first.side_by_side is not None)
    assert "were read back from earlier tunes" in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("bad", ["{not json", "null", "[]", '{"a": 1}', '{"a": [[1], [0]]}'])
def test_damaged_recorded_proposals_are_refused_naming_the_file(tmp_path, bad):
    """The proposals a model draft made alone, replayed under load: a file that is not them is named (before,
    `null` and `[]` raised AttributeError from `.items`)."""
    from specbench.decode.replay_drafter import load_proposals, save_proposals

    path = tmp_path / "point.proposals.json"
    save_proposals(path, {"0:3": ([5, 6], [-1, 0], 0.01, "suffix")})
    assert load_proposals(path) == {"0:3": ([5, 6], [-1, 0], 0.01, "suffix")}  # which of a hybrid's drafters
    save_proposals(path, {"0:3": ([5, 6], [-1, 0], 0.01)})  # recorded before sources were kept
    assert load_proposals(path) == {"0:3": ([5, 6], [-1, 0], 0.01, "")}
    path.write_text(bad)
    with pytest.raises(SpecbenchError, match="point.proposals.json are unreadable"):
        load_proposals(path)


@pytest.mark.parametrize("document,words", [
    ([1, 2], "holds a list, not an object"),
    ({"target": "smollm2-135m", "method": "chain", "k": "four"}, "k='four'"),
    ({"target": "smollm2-135m", "method": "chain", "k": -1}, "k=-1"),
    ({"target": 5, "method": "chain", "k": 2}, "target=5"),
    ({"target": "smollm2-135m", "method": "chain", "k": 2, "kernels": "fast"}, "kernels='fast'"),
])
def test_an_edited_tune_configuration_is_refused_naming_the_bad_value(tmp_path, document, words):
    """`run`/`serve --config` read it; before, `"k": "four"` came out as a TypeError comparing str and int."""
    from specbench.tune.report import read_config

    path = tmp_path / "tune.json"
    path.write_text(json.dumps(document))
    with pytest.raises(SpecbenchError, match=words):
        read_config(path)


def test_a_sampled_tune_records_measures_and_configures_at_its_temperature(tmp_path):
    """A service at temperature 0.8 accepts other drafts than a greedy one: before, a tune had no temperature
    and its checked choice was greedy's."""
    from specbench.cli import build_parser
    from specbench.plan.library import load_references
    from specbench.tune.command import apply_config
    from specbench.tune.phases import Store, point_key
    from specbench.tune.report import read_config
    from specbench.tune.spec import Candidate

    greedy = tune(spec(drafts=(DRAFT,), measure_share=0.0), tmp_path, progress=False)
    assert (read_config(greedy.config_path)["rule"], greedy.chosen["temperature"]) == ("greedy", 0.0)
    sampled = tune(spec(drafts=(DRAFT,), measure_share=0.0, temperature=0.8), tmp_path, progress=False)
    references = load_references(tmp_path / "reference")
    assert sorted((r.temperature, r.rule) for r in references) == [(0.0, "greedy"), (0.8, "rejection")]
    assert sampled.calibration["acceptance_replayed"] == [] and greedy.calibration["acceptance_replayed"] == [DRAFT]
    store, held, first = Store(tmp_path), list(PROMPTS[3:6]), Candidate(DRAFT, "chain", draft=DRAFT)
    outputs = [store.measured(point_key(s, first, "target-only", 0, held))["emitted_tokens"].tolist()
               for s in (spec(drafts=(DRAFT,)), spec(drafts=(DRAFT,), temperature=0.8))]
    assert outputs[0] != outputs[1], "the sampled tune's target-only run is greedy's"
    config = read_config(sampled.config_path)
    assert (config["temperature"], config["rule"]) == (0.8, "rejection")
    assert "Sampled at temperature 0.8, verified by rejection" in sampled.report_path.read_text()
    args = build_parser().parse_args(["run", "--config", str(sampled.config_path)])
    apply_config(args)
    assert (args.temperature, args.rule) == (0.8, "rejection")
    with_trees = spec(drafts=(DRAFT,), temperature=0.8, tree_budgets=(4,))
    assert with_trees.sampling().rule == "sample-match"  # dynamic trees: the default turns to sample-match


@pytest.mark.parametrize("overrides,message", [
    (dict(temperature=0.8, rule="rejection", tree_budgets=(4,)), "rejection cannot verify the dynamic trees"),
    (dict(temperature=0.8, rule="nucleus"), "rule 'nucleus'"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=0.8, rule="greedy"), "rule 'greedy' verifies by the target's argmax"),
])
def test_a_sampled_tune_that_cannot_run_is_refused_by_name_before_any_work(tmp_path, overrides, message):
    with pytest.raises(SpecbenchError, match=message):
        tune(spec(**overrides), tmp_path, progress=False)
    assert not list(tmp_path.rglob("profile-*.json")), "work started before the refusal"


def test_a_sampled_tune_under_load_is_refused_for_model_drafts_whose_load_replays_greedy_proposals():
    from specbench.tune.spec import Candidate, check_sampled_load

    loaded = spec(temperature=0.7, endpoint="tcp://127.0.0.1:5555", clients=(1, 4))
    with pytest.raises(SpecbenchError, match=r"prompt-lookup and suffix only.*\['qwen'\]"):
        check_sampled_load(loaded, [Candidate("qwen", "chain", draft="qwen"), Candidate("suffix", "suffix")])
    check_sampled_load(loaded, [Candidate("suffix", "suffix"), Candidate("prompt-lookup", "prompt-lookup")])
    check_sampled_load(spec(endpoint="tcp://127.0.0.1:5555", clients=(1, 4)), [Candidate("qwen", "chain")])


def test_a_rerun_at_another_cs_chooses_among_the_points_an_earlier_tune_in_its_folder_measured(tmp_path, monkeypatch):
    """Before, a rerun at cs=0 after one at cs=0.5 ignored the points only the first had listed, and chose a
    slower one than a point measured (and stored) in the same folder."""
    import specbench.tune.run as tune_run

    # the first tune measures every point, so it has stored some the second would not list whatever the timings
    # (left to the ranking, a busy machine once made both list the same four points)
    every = lambda predicted, spec, free=(): [r for r in predicted.to_dict("records") if r["kind"] != "none"]  # noqa: E731
    with monkeypatch.context() as patch:
        patch.setattr(tune_run, "_to_measure", every)
        first = tune(spec(cs=1.0, measure_share=0.0), tmp_path / "tune", progress=False)
    alone = tune(spec(cs=0.0, measure_share=0.0), tmp_path / "alone", progress=False)
    assert set(first.measured["label"]) - set(alone.measured["label"]), "the two tunes list the same points"
    from specbench.tune.phases import MACHINES

    # (the machines index is not a point: it grows when the rerun measures anything new, a side-by-side run say)
    stamps = {path: path.stat().st_mtime_ns for path in (tmp_path / "tune" / "measured").glob("*.json")
              if path.name != MACHINES}
    second = tune(spec(cs=0.0, measure_share=0.0), tmp_path / "tune", progress=False)
    assert set(first.measured["label"]) <= set(second.measured["label"])
    assert second.measured["label"].is_unique
    assert all(path.stat().st_mtime_ns == stamp for path, stamp in stamps.items()), "a stored point was measured again"
    chose_from = second.measured if second.side_by_side is None else second.side_by_side
    fastest = chose_from.loc[chose_from["measured_tokens_per_s"].idxmax()]
    assert second.chosen["label"] == fastest["label"]  # cs=0: the fastest measured point, wherever it was measured
    if second.side_by_side is not None:  # the two it ran side by side are the fastest two measured apart
        best = second.measured[second.measured["method"] != "target-only"].nlargest(1, "measured_tokens_per_s")
        assert best["label"].iloc[0] == second.side_by_side["label"].iloc[1]


def test_close_best_points_run_side_by_side_and_the_choice_is_made_on_that_run(tmp_path, monkeypatch):
    """Points measured minutes apart on a drifting VM once chose prompt lookup over a chain that, interleaved,
    ran faster (benchmarks/results/2026-12-03-tune-at-a-temperature.md)."""
    import specbench.tune.duel as duel

    monkeypatch.setattr(duel, "CLOSE", float("inf"))  # any two points count as close
    settings = dict(drafts=(DRAFT, "prompt-lookup"), chain_ks=(2,), measure_share=0.0)
    result = tune(spec(**settings), tmp_path, progress=False)
    table = result.side_by_side
    assert table is not None and table["method"].iloc[0] == "target-only"
    assert set(table["method"].iloc[1:]) == {"chain", "prompt-lookup"}
    chosen = table.loc[table["label"] == result.chosen["label"]].iloc[0]
    assert result.chosen["measured_tokens_per_s"] == pytest.approx(chosen["measured_tokens_per_s"], rel=1e-3)
    assert "ran side by side" in result.report_path.read_text()
    stored = {p: p.stat().st_mtime_ns for p in (tmp_path / "measured").glob("duel-*.json")}
    assert len(stored) == 1
    again = tune(spec(**settings), tmp_path, progress=False)  # resumed: the side-by-side run is read, not rerun
    assert {p: p.stat().st_mtime_ns for p in stored} == stored
    assert again.side_by_side["measured_tokens_per_s"].tolist() == pytest.approx(table["measured_tokens_per_s"].tolist())
    monkeypatch.setattr(duel, "CLOSE", -1.0)  # nothing is close: chosen from the points as measured apart
    assert tune(spec(**settings), tmp_path / "apart", progress=False).side_by_side is None


def test_the_best_point_runs_beside_the_next_best_one_call_can_hold():
    import pandas as pd

    from specbench.tune.duel import contenders
    from specbench.tune.spec import Candidate

    def table(*points):
        rows = [("target-only", "target-only", 0, 10.0)] + list(points)
        return pd.DataFrame([dict(label=f"{c}: {m} K={k}", candidate=c, method=m, k=k, clients=1,
                                  measured_tokens_per_s=speed, total_cost_usd_per_mtok=100 / speed)
                             for c, m, k, speed in rows])

    a, b, lookup = (Candidate("a", "chain", draft="a"), Candidate("b", "chain", draft="b"),
                    Candidate("prompt-lookup", "prompt-lookup"))
    drafts = {"a": object(), "b": object(), "prompt-lookup": None}
    together = contenders(table(("a", "chain", 3, 15.0), ("prompt-lookup", "prompt-lookup", 3, 14.5)),
                          spec(), [a, b, lookup], drafts)
    assert [row["candidate"] for row in together] == ["a", "prompt-lookup"]
    assert contenders(table(("a", "chain", 3, 15.0), ("a", "chain", 4, 14.8)), spec(), [a, lookup], drafts) is None
    beside = contenders(table(("a", "chain", 3, 15.0), ("a", "chain", 4, 14.8), ("prompt-lookup", "prompt-lookup", 3,
                                                                             14.0)), spec(), [a, lookup], drafts)
    assert [row["label"] for row in beside] == ["a: chain K=3", "prompt-lookup: prompt-lookup K=3"]  # K=4 skipped
    assert contenders(table(("a", "chain", 3, 15.0), ("b", "chain", 3, 14.8)), spec(), [a, b], drafts) is None
    assert contenders(table(("a", "chain", 3, 30.0), ("prompt-lookup", "prompt-lookup", 3, 11.0)), spec(),
                      [a, lookup], drafts) is None  # not close
