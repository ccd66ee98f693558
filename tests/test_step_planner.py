"""Per-step planning: hand-computed choices, adaptation to live acceptance and RTT, losslessness."""
import pytest

from specbench.api import outputs, run
from specbench.plan.costs import Prices
from specbench.plan.predict import AcceptanceReference, LatencyProfile
from specbench.plan.step_planner import StepPlanner, planner_from_caches, positional_rates
from specbench.types import SpecbenchError

from conftest import PROMPTS


def flat(model: str, seconds: float) -> LatencyProfile:
    """A forward that costs `seconds` whatever the tokens and context."""
    return LatencyProfile(model, "test", rows=((1, 512, seconds), (64, 512, seconds)))


def halving_reference() -> AcceptanceReference:
    """Accepted lengths 0..6 with frequencies 1/2, 1/4, ... so every alpha_i is exactly 1/2."""
    accepts = [a for a, count in enumerate([32, 16, 8, 4, 2, 1]) for _ in range(count)] + [6]
    return AcceptanceReference("d", "t", "x", max_chain=6, chain_accepts=tuple(accepts))


def test_positional_rates_from_reference():
    rates = positional_rates(halving_reference(), 6)
    assert [a / t for a, t in rates] == [0.5] * 6


def test_hand_computed_choice_speed_versus_cost():
    # target 100 ms flat, draft 30 ms/token, alpha = 1/2: tokens/s for K = 0, 1, 2, 3 is
    # 1/0.1 = 10, 1.5/0.13 = 11.54, 1.75/0.16 = 10.94, 1.875/0.19 = 9.87 -> fastest is K=1.
    planner = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(), cs=0.0, prior_steps=1e6)
    scores = planner.scores(context=100)
    assert [round(r["tokens_per_s"], 2) for r in scores[:4]] == [10.0, 11.54, 10.94, 9.87]
    assert planner.choose(100) == 1
    # A remote target's GPU-hours count only its verify seconds per token, 0.1 / (2 - 2^-K), the client drafting:
    # cheapest at the longest chain.
    free = Prices(draft_usd_per_kwh=0.0, usd_per_gb_down=0.0)
    cheap = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(), cs=1.0, prior_steps=1e6,
                        prices=free, where="remote")
    assert cheap.choose(100) == 6
    # Placed locally, the draft holds the same device: (0.1 + 0.03 K) / (2 - 2^-K) per token, cheapest where fastest.
    local = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(), cs=1.0, prior_steps=1e6, prices=free)
    costs = [r["api_cost_usd_per_mtok"] for r in local.scores(context=100)[:3]]
    assert [round(c / (2 / 3600 * 1e6), 4) for c in costs] == [0.1, round(0.13 / 1.5, 4), round(0.16 / 1.75, 4)]
    assert local.choose(100) == 1


def test_remote_rtt_pushes_longer_chains():
    local = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(), prior_steps=1e6)
    remote = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(), prior_steps=1e6,
                         where="remote", rtt_ms=200.0)
    # with 200 ms per round trip, K=2 (1.75 tokens / 0.36 s) beats K=1 (1.5 / 0.33 s)
    assert local.choose(100) == 1 and remote.choose(100) >= 2
    remote.observe(drafted=2, accepted=2, network_s=0.0)  # 0 = no measurement; estimate kept
    assert remote.rtt_ms == 200.0
    for _ in range(30):
        remote.observe(drafted=2, accepted=1, network_s=0.001)
    assert remote.rtt_ms < 5


def test_live_acceptance_moves_the_choice_and_probing_recovers():
    good = AcceptanceReference("d", "t", "x", max_chain=6, chain_accepts=(6,) * 20)
    planner = StepPlanner(flat("t", 0.100), flat("d", 0.030), good, explore_after=4)
    assert planner.choose(100) == 6
    for _ in range(15):
        planner.observe(drafted=6, accepted=0)
    assert planner.choose(100) == 0
    choices = [planner.choose(100) for _ in range(5)]
    assert choices == [0, 0, 0, 1, 0], choices  # a probe after 4 plain steps, then back to 0
    for _ in range(15):
        planner.observe(drafted=1, accepted=1)
    assert planner.choose(100) >= 1
    planner.reset()
    assert planner.choose(100) == 6


def test_bad_planner_settings():
    reference = halving_reference()
    with pytest.raises(SpecbenchError, match="cs"):
        StepPlanner(flat("t", 0.1), flat("d", 0.01), reference, cs=1.5)
    with pytest.raises(SpecbenchError, match="K=8"):
        StepPlanner(flat("t", 0.1), flat("d", 0.01), reference, max_k=8)
    with pytest.raises(SpecbenchError, match="no chain steps"):
        StepPlanner(flat("t", 0.1), flat("d", 0.01), AcceptanceReference("d", "t", "x"))
    with pytest.raises(SpecbenchError, match="no cached profiles"):
        planner_from_caches("no-such-target", "no-such-draft")


def test_cli_plan_needs_a_pair(capsys):
    from specbench.cli import main

    assert main(["run", "--target", "smollm2-135m", "--method", "chain", "--plan"]) == 2
    assert "pass --draft" in capsys.readouterr().err


def test_cli_plan_reads_the_targets_devices_profile_and_knows_when_it_has_only_anothers():
    """`specbench run --plan` once planned from this CPU's profile wherever the target ran (a GPU, a worker)."""
    from types import SimpleNamespace

    from specbench.models.spec import ModelSpec
    from specbench.plan.library import load_profiles
    from specbench.run_command import _planner

    args = SimpleNamespace(cs=0.0, k=6, draft_budget_mib=None, dtype="float32", worker=None)
    for device in {p.device for p in load_profiles(model="smollm2-135m", dtype="float32")}:  # each shipped one
        planner = _planner(args, ModelSpec("smollm2-135m"), None, device)
        assert planner.target.device == device and planner.profile_note(device, "float32") is None
    elsewhere = _planner(args, ModelSpec("smollm2-135m"), None, "NVIDIA-H200")
    assert elsewhere.target.device.startswith("cpu-")  # a CPU's profile: the cache holds no GPU's of SmolLM2
    assert (f"profile of smollm2-135m measured on {elsewhere.target.device}, and the target runs on NVIDIA-H200"
            in elsewhere.profile_note("NVIDIA-H200", "float32"))
    assert elsewhere.where == "local"
    args.worker = "tcp://127.0.0.1:5555"  # through a worker: the planner follows the network time and its batch
    assert _planner(args, ModelSpec("smollm2-135m"), None, "NVIDIA-H200").where == "remote"


def test_planned_runs_stay_lossless_and_vary_k(tiny_target, tiny_draft):
    planner = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(), max_k=6, prior_steps=2,
                          forget=0.7)
    records = run(tiny_target, PROMPTS, method=["target-only", "chain"], draft=tiny_draft, k=6,
                  max_new_tokens=30, progress=False, planner=planner)  # the baseline ignores the planner
    produced = outputs(records)
    for index in range(len(PROMPTS)):
        assert produced[("chain+planner", index)] == produced[("target-only", index)]
    planned = records[records.method == "chain+planner"]
    assert planned["step_k"].nunique() > 1, "the planner never changed K"
    assert (planned["drafted"] <= planned["step_k"]).all()
    with pytest.raises(SpecbenchError, match="not a chain method"):
        run(tiny_target, PROMPTS, method="tree", draft=tiny_draft, planner=planner, progress=False)


def test_shipped_caches_give_a_planner():
    planner = planner_from_caches("smollm2-135m", "smollm2-135m[:26]", dataset="bench")
    assert 0 <= planner.choose(200) <= planner.max_k


def test_planner_drafts_less_when_the_worker_is_loaded():
    """SmartSpec's point: under load (large batches) each verified token costs a batched forward."""
    from specbench.plan.predict import AcceptanceReference, LatencyProfile

    # verify cost per extra token grows 8x faster at batch 8 than at batch 1 (compute-bound when shared)
    target = LatencyProfile("t", "cpu", rows=((1, 256, 0.100, 1), (9, 256, 0.116, 1),
                                              (1, 256, 0.200, 8), (9, 256, 0.600, 8)))
    draft = LatencyProfile("d", "cpu", rows=((1, 256, 0.004), (2, 256, 0.005)))
    reference = AcceptanceReference("d", "t", "x", max_chain=8, chain_accepts=(8, 6, 8, 5, 7, 8, 4, 8))
    chosen = {}
    for batch_size in (1, 8):  # the same verdicts, only the worker's load differs
        planner = StepPlanner(target, draft, reference, max_k=8, where="remote", rtt_ms=10.0)
        for step in range(30):  # acceptance falling with position, as drafts usually do
            planner.observe(drafted=8, accepted=(0, 1, 2, 3, 4, 5, 6, 8)[step % 8], network_s=0.01,
                            batch_size=batch_size)
        assert round(planner.clients) == batch_size
        chosen[batch_size] = planner.choose(256)
    assert chosen[8] < chosen[1], chosen


def test_draft_memory_budget_caps_k_as_the_context_grows():
    """Issue 14: the draft device's memory is an input to the planner. Weights 1000 B, 10 B of cache
    per token, a 2100 B budget: K=6 fits at context 100 (1000 + 1060), K=3 at context 107 (1000 + 1100),
    nothing at context 110, where the step is a plain target step (and the probe is skipped)."""
    from dataclasses import replace

    draft = replace(flat("d", 0.001), weight_bytes=1000, kv_bytes_per_token=10)
    eager = AcceptanceReference("d", "t", "x", max_chain=6, chain_accepts=(6,) * 20)
    planner = StepPlanner(flat("t", 0.100), draft, eager, prior_steps=1e6, explore_after=1, draft_budget_bytes=2100)
    assert planner.choose(100) == 6
    assert planner.choose(107) == 3
    assert [row["fits"] for row in planner.scores(107)] == [True, True, True, True, False, False, False]
    assert planner.choose(110) == 0 and planner.choose(110) == 0  # no probe: one token does not fit either
    unlimited = StepPlanner(flat("t", 0.100), draft, eager, prior_steps=1e6)
    assert unlimited.choose(110) == 6


def test_draft_memory_budget_refusals_name_the_problem():
    from dataclasses import replace

    with pytest.raises(SpecbenchError, match="record it again with `specbench profile`"):
        StepPlanner(flat("t", 0.1), flat("d", 0.01), halving_reference(), draft_budget_bytes=10**9)
    heavy = replace(flat("d", 0.01), weight_bytes=300 * 2**20)
    with pytest.raises(SpecbenchError, match=r"weights take 300.0 MiB, the budget is 100.0 MiB"):
        StepPlanner(flat("t", 0.1), heavy, halving_reference(), draft_budget_bytes=100 * 2**20)
    with pytest.raises(SpecbenchError, match="does not fit the draft memory budget"):
        planner_from_caches("smollm2-135m", "smollm2-135m[:26]", dataset="bench", draft_budget_mib=1)


def lookup_reference(accepts=(8, 6, 8, 5, 7, 8, 4, 8)) -> AcceptanceReference:
    return AcceptanceReference("prompt-lookup", "t", "x", max_chain=8, chain_accepts=tuple(accepts))


def test_prompt_lookup_planner_prices_only_the_verify():
    # Drafting is free, so with a flat verify every extra token is a free lottery ticket: the longest K.
    assert StepPlanner(flat("t", 0.100), None, lookup_reference(), max_k=8, prior_steps=1e6).choose(100) == 8
    # Alone each verified token adds 20 ms: K=6 (1 + 5.625) / 0.22 = 30.1 tok/s against 10 at K=0. Loaded
    # (batch 8) it adds 200 ms: K=1 gives 2 / 0.3 = 6.7 tok/s per client, K=0 10: plain target steps.
    steep = LatencyProfile("t", "cpu", rows=((1, 256, 0.100, 1), (9, 256, 0.260, 1),
                                             (1, 256, 0.100, 8), (9, 256, 1.700, 8)))
    chosen = {}
    for batch_size in (1, 8):
        planner = StepPlanner(steep, None, lookup_reference(), max_k=8, where="remote", prior_steps=1e6)
        for _ in range(30):
            planner.observe(drafted=8, accepted=8, network_s=0.0, batch_size=batch_size)
        assert all(row["draft_energy_j_per_mtok"] == 0.0 for row in planner.scores(256))  # lookup costs nothing
        chosen[batch_size] = planner.choose(256)
    assert chosen[1] >= 6 and chosen[8] == 0, chosen


def test_prompt_lookup_planner_runs_lossless_and_refuses_model_drafts(tiny_target, tiny_draft):
    planner = StepPlanner(flat("t", 0.100), None, lookup_reference((2, 0, 1, 3, 0, 8, 1, 0)), max_k=4,
                          prior_steps=2, forget=0.7)
    records = run(tiny_target, PROMPTS, method=["target-only", "prompt-lookup"], k=4, max_new_tokens=30,
                  progress=False, planner=planner)
    produced = outputs(records)
    for index in range(len(PROMPTS)):
        assert produced[("prompt-lookup+planner", index)] == produced[("target-only", index)]
    planned = records[records.method == "prompt-lookup+planner"]
    assert (planned["drafted"] <= planned["step_k"]).all()
    with pytest.raises(SpecbenchError, match="built for 'prompt-lookup'"):
        run(tiny_target, PROMPTS, method="chain", draft=tiny_draft, planner=planner, progress=False)
    with pytest.raises(SpecbenchError, match="built for 'd'"):  # and a model draft's planner for prompt lookup
        run(tiny_target, PROMPTS, method="prompt-lookup", progress=False,
            planner=StepPlanner(flat("t", 0.1), flat("d", 0.03), halving_reference()))
    with pytest.raises(SpecbenchError, match="plans prompt lookup"):
        StepPlanner(flat("t", 0.1), None, halving_reference())
    with pytest.raises(SpecbenchError, match="prompt lookup holds none"):
        StepPlanner(flat("t", 0.1), None, lookup_reference(), draft_budget_bytes=2**20)


def test_prompt_lookup_reference_and_the_shipped_one(tiny_target):
    from specbench.record import record_reference

    reference = record_reference(tiny_target, "prompt-lookup", PROMPTS, dataset="tiny", max_chain=4,
                                 max_new_tokens=24, target_name="tiny")
    assert reference.draft == "prompt-lookup" and reference.max_chain == 4
    assert all(0 <= a <= 4 for a in reference.chain_accepts)
    planner = planner_from_caches("smollm2-135m", "prompt-lookup", dataset="mt-bench", where="remote")
    assert planner.draft is None and 0 <= planner.choose(200) <= planner.max_k


def test_a_planner_for_a_target_here_is_refused_beside_a_worker():
    """A planner built with where='local' prices no network time and no worker load: beside a RemoteTarget it
    once chose K as if the target were in this process (`specbench run --worker --plan` built one so)."""
    from types import SimpleNamespace

    from specbench.methods import check_runnable, get_method

    worker = SimpleNamespace(generate_on_worker=lambda *a, **k: None)  # what marks a RemoteTarget here
    here = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference())
    with pytest.raises(SpecbenchError, match="where='remote'"):
        check_runnable(get_method("chain"), worker, here)
    check_runnable(get_method("chain"), worker, StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(),
                                                            where="remote"))
    check_runnable(get_method("chain"), object(), here)  # a target in this process
    check_runnable(get_method("target-only"), worker, here)  # a baseline beside it runs as it is


def test_a_planner_priced_on_another_device_or_dtype_says_so_where_it_runs(tiny_target, tiny_draft):
    """A planner's K are priced from its target profile: run beside a target on another device, or in another
    dtype (planner_from_caches without a dtype may read a bf16 profile for a float32 run), it warns."""
    from dataclasses import replace

    from specbench.hardware import device_name

    planner = StepPlanner(flat("t", 0.100), flat("d", 0.030), halving_reference(), max_k=4)
    with pytest.warns(UserWarning, match=r"profile of t measured on test, and the target runs on cpu-"):
        run(tiny_target, PROMPTS[:1], method="chain", draft=tiny_draft, k=4, max_new_tokens=8, progress=False,
            planner=planner)
    here = replace(flat("t", 0.100), device=device_name("cpu"), dtype="float32")
    assert StepPlanner(here, flat("d", 0.030), halving_reference()).profile_note(device_name("cpu"), "float32") is None
    other = StepPlanner(replace(here, dtype="bfloat16"), flat("d", 0.030), halving_reference())
    assert "measured in bfloat16, and the target runs in float32" in other.profile_note(device_name("cpu"), "float32")
    assert other.profile_note(device_name("cpu")) is None  # the target's dtype unknown: nothing said of it
