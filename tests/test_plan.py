"""Cost formulas by hand, Pareto frontier vs brute force, the cost knob's extremes, replay prediction."""
import dataclasses
import random

import pytest

from specbench.plan.costs import (Network, Power, Prices, StepCost, api_cost_per_mtok, cost_knob,
                                  draft_energy_j_per_mtok, total_cost_per_mtok)
from specbench.plan.objectives import objective_value
from specbench.plan.predict import (AcceptanceReference, LatencyProfile, OperatingPoint, break_even_acceptance,
                                    choose, pareto_front, predict)
from specbench.types import SpecbenchError

STEP = StepCost(tokens_per_step=4.0, draft_s=0.02, verify_s=0.036, network_s=0.05, overhead_s=0.004,
                bytes_up=1000, bytes_down=200)


def test_api_cost_by_hand():
    # $3.60/h = $0.001/s; 0.036 s verify per 4 tokens -> 9e-6 $/token -> $9 per 1M tokens
    assert api_cost_per_mtok(STEP, Prices(target_usd_per_hour=3.6)) == pytest.approx(9.0)
    assert api_cost_per_mtok(STEP, Prices(target_usd_per_mtok=0.5)) == 0.5


def test_total_cost_by_hand():
    prices = Prices(target_usd_per_hour=3.6, draft_usd_per_kwh=0.36, usd_per_gb_up=0.01, usd_per_gb_down=0.1)
    power = Power(draft_watts=10)
    # draft: 10 W * 0.02 s / 4 tokens = 0.05 J/token = 5e4 J per 1M -> /3.6e6 * 0.36 = $0.005
    # wire: per token 250 B up, 50 B down -> per 1M: 0.25 GB * 0.01 + 0.05 GB * 0.1 = $0.0075
    assert draft_energy_j_per_mtok(STEP, power) == pytest.approx(5e4)
    assert total_cost_per_mtok(STEP, prices, power) == pytest.approx(9.0 + 0.005 + 0.0075)


def test_drafting_on_the_targets_device_is_billed_as_its_time_and_drawn_at_its_power():
    """A local draft (or one on the worker) holds the device the target is priced on: billing the verify alone
    priced a local chain like a remote one, so the remote point of a pair could never be the cheaper."""
    prices = Prices(target_usd_per_hour=3.6, draft_usd_per_kwh=0.36, usd_per_gb_up=0.0, usd_per_gb_down=0.0)
    power = Power(draft_watts=10, target_watts=300)
    held = dataclasses.replace(STEP, drafts_on_target=True)
    # (0.036 verify + 0.02 drafting) s per 4 tokens at $0.001/s -> $14 per 1M tokens; the client spends nothing
    assert api_cost_per_mtok(held, prices) == pytest.approx(14.0)
    assert total_cost_per_mtok(held, prices, power) == pytest.approx(14.0)
    assert draft_energy_j_per_mtok(held, power) == pytest.approx(300 * 0.02 / 4 * 1e6)
    assert objective_value("target_energy", held, prices, power) == pytest.approx(300 * 0.036 / 4 * 1e6)
    # batched clients share the verify, never each other's drafting
    shared = dataclasses.replace(held, clients=4)
    assert api_cost_per_mtok(shared, prices) == pytest.approx(0.001 * (0.036 / 4 + 0.02) / 4 * 1e6)


def test_a_pairs_remote_point_can_be_the_cheaper_and_a_worker_side_draft_is_billed_to_the_worker():
    reference = AcceptanceReference("d", "t", "x", max_chain=4, chain_accepts=(2, 2, 2, 2))
    prices = Prices(usd_per_gb_down=0.0)
    local, remote, worker = predict([OperatingPoint("chain", 2), OperatingPoint("chain", 2, "remote", 0.0),
                                     OperatingPoint("eagle-server", 2, "remote", 0.0)], TARGET, DRAFT, reference, prices)
    assert local["tokens_per_s"] == pytest.approx(remote["tokens_per_s"])  # no round trip: the same step
    assert local["api_cost_usd_per_mtok"] > 1.2 * remote["api_cost_usd_per_mtok"]
    assert worker["api_cost_usd_per_mtok"] == pytest.approx(local["api_cost_usd_per_mtok"])
    assert worker["total_cost_usd_per_mtok"] < remote["total_cost_usd_per_mtok"] + worker["api_cost_usd_per_mtok"]


def test_objectives_and_network():
    assert objective_value("latency", STEP, Prices(), Power()) == pytest.approx(0.11 / 4)
    assert Network(rtt_ms=50, bandwidth_mbps=8).transfer_s(1000, 0) == pytest.approx(0.051)
    with pytest.raises(SpecbenchError, match="unknown objective"):
        objective_value("speed", STEP, Prices(), Power())


def test_cost_knob_formula_and_range():
    assert cost_knob(0.25, cost=2, cost_ref=4, tps=10, tps_ref=5) == pytest.approx(0.25 * 0.5 + 0.75 * 0.5)
    for bad in (-0.1, 1.5):
        with pytest.raises(SpecbenchError, match=r"cs must be in \[0, 1\]"):
            cost_knob(bad, 1, 1, 1, 1)
    with pytest.raises(SpecbenchError, match="price"):
        Prices(target_usd_per_hour=-1)


def test_pareto_front_matches_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        rows = [{"tokens_per_s": rng.uniform(1, 10), "total_cost_usd_per_mtok": rng.uniform(1, 10)} for _ in range(30)]
        front = pareto_front(rows)
        brute = [r for r in rows if not any(
            o["tokens_per_s"] >= r["tokens_per_s"] and o["total_cost_usd_per_mtok"] <= r["total_cost_usd_per_mtok"]
            and o is not r for o in rows)]
        assert sorted(map(id, front)) == sorted(map(id, brute))


def test_cs_extremes_pick_fastest_and_cheapest():
    rng = random.Random(1)
    rows = [{"label": f"p{i}", "method": "chain", "tokens_per_s": rng.uniform(1, 10),
             "total_cost_usd_per_mtok": rng.uniform(1, 10)} for i in range(20)]
    rows.append({"label": "base", "method": "target-only", "tokens_per_s": 3.0, "total_cost_usd_per_mtok": 5.0})
    assert choose(rows, 0.0) is max(rows, key=lambda r: r["tokens_per_s"])
    assert choose(rows, 1.0) is min(rows, key=lambda r: r["total_cost_usd_per_mtok"])


TARGET = LatencyProfile("t", "cpu", rows=((1, 256, 0.10), (4, 256, 0.16), (8, 256, 0.24), (1, 1024, 0.12)))
DRAFT = LatencyProfile("d", "cpu", rows=((1, 256, 0.02), (4, 256, 0.03)))


def test_latency_profile_interpolates_within_and_extends_beyond():
    assert TARGET.forward_s(4, 256) == pytest.approx(0.16)
    assert TARGET.forward_s(6, 200) == pytest.approx(0.20)
    assert TARGET.forward_s(12, 256) == pytest.approx(0.32)  # last slope
    assert TARGET.forward_s(1, 2000) == pytest.approx(0.12)  # largest measured context


def test_chain_prediction_replays_min_a_k():
    reference = AcceptanceReference("d", "t", "x", max_chain=4, chain_accepts=(0, 1, 4, 2))
    assert reference.accepted("chain", 2) == pytest.approx((0 + 1 + 2 + 2) / 4)
    with pytest.raises(SpecbenchError, match="cannot predict K=6"):
        reference.accepted("chain", 6)
    with pytest.raises(SpecbenchError, match="rather than interpolate"):
        reference.accepted("tree", 16)
    rows = predict([OperatingPoint("target-only"), OperatingPoint("chain", 2)], TARGET, DRAFT, reference)
    base, chain = rows
    assert base["tokens_per_s"] == pytest.approx(10.0)
    # chain K=2: the draft's first forward catches up on the bonus, plus its own last token after the
    # half of the steps that accepted both (a >= 2): 1.5 tokens, 0.02 + 0.5 * 0.01 / 3 s; then one
    # 1-token forward 0.02 s, and the verify of 3 tokens 0.14 s; 2.25 tokens per step
    assert reference.full_acceptance(2) == pytest.approx(0.5)
    assert chain["tokens_per_step"] == pytest.approx(2.25)
    assert chain["tokens_per_s"] == pytest.approx(2.25 / (0.02 + 0.5 * 0.01 / 3 + 0.02 + 0.14))


def test_the_draft_catches_up_as_the_cost_model_assumes(tiny_target, tiny_draft):
    """The chain cost model prices the draft's first forward of a step at 1 token (the bonus), or 2
    after a fully accepted chain (its own last token, never fed, and the bonus): checked against what
    a ModelDrafter actually feeds, over a run with both outcomes."""
    from specbench.decode.drafters import ModelDrafter
    from specbench.decode.loop import Decoding, generate
    from specbench.decode.target import LocalTarget
    from specbench.types import SamplingParams

    k, fed = 3, []
    drafter = ModelDrafter(tiny_draft, tiny_target.vocab_size)
    extend = drafter._extend
    drafter._extend = lambda ids: (fed.append(len(ids)), extend(ids))[1]
    result = generate(LocalTarget(tiny_target), drafter, [1, 2, 3, 4, 5, 6, 7, 8], Decoding(k, 40, SamplingParams()))
    steps = [(record.drafted, record.accepted) for record in result.records]
    assert len(fed) == sum(drafted for drafted, _ in steps)  # per step: a catch-up, then 1-token forwards
    starts = [sum(drafted for drafted, _ in steps[:i]) for i in range(1, len(steps))]
    catch_ups = [fed[start] for start in starts]  # each step's first forward (the first step's is the prompt)
    assert catch_ups == [1 + (accepted == drafted) for drafted, accepted in steps[:-1]]
    assert {1, 2} <= set(catch_ups)  # both outcomes occurred


def test_break_even_acceptance():
    # K=4: 4*0.02 + 0.20 = 0.28 s vs 0.10 s baseline -> needs 1.8 accepted tokens per step
    target = LatencyProfile("t", "cpu", rows=((1, 256, 0.10), (5, 256, 0.20)))
    assert break_even_acceptance(target, DRAFT, 4) == pytest.approx(1.8)


def test_break_even_frame_marks_where_sd_pays_off():
    from specbench.plan.explore import break_even_frame

    target = LatencyProfile("t", "cpu", rows=((1, 256, 0.10), (5, 256, 0.20)))
    reference = AcceptanceReference("d", "t", "x", max_chain=4, chain_accepts=(0, 1, 2, 3, 4))  # mean min(a, 4) = 2
    frame = break_even_frame(target, DRAFT, reference, ks=(4,), rtts_ms=(0.0, 100.0))
    local, remote = frame.to_dict("records")
    # local: needs 1.8 (above); with 100 ms per round trip on both sides: 0.38 / 0.20 - 1 = 0.9
    assert local["break_even_accepted"] == pytest.approx(1.8) and local["pays_off"]
    assert remote["break_even_accepted"] == pytest.approx(0.9) and remote["measured_accepted"] == pytest.approx(2.0)
    frame = break_even_frame(target, DRAFT, AcceptanceReference("d", "t", "x", max_chain=4, chain_accepts=(1, 1)),
                             ks=(4,))
    assert not frame["pays_off"].iloc[0]


SHARED = LatencyProfile("t", "cpu", rows=((1, 256, 0.10, 1), (5, 256, 0.15, 1), (1, 256, 0.20, 4), (5, 256, 0.30, 4)))


def test_forward_time_over_batch_size():
    assert SHARED.batches == [1, 4]
    assert SHARED.forward_s(1, 256, batch=5) == pytest.approx(0.2 + 0.1 / 3)  # the docstring's example: last slope
    assert SHARED.forward_s(5, 256, batch=2) == pytest.approx(0.15 + 0.15 / 3)
    assert TARGET.forward_s(4, 256, batch=3) == pytest.approx(3 * 0.16)  # batch 1 only: no batching gain assumed


def test_clients_share_the_target_cost_and_each_waits_for_the_batch():
    reference = AcceptanceReference("d", "t", "x", max_chain=4, chain_accepts=(4, 0, 2, 2))
    alone, shared = (predict([OperatingPoint("chain", 4, "remote", 10.0, clients=n)], SHARED, DRAFT, reference)[0]
                     for n in (1, 4))
    assert shared["step_ms"] - alone["step_ms"] == pytest.approx(1000 * (0.30 - 0.15))  # the batched forward is longer
    assert shared["aggregate_tokens_per_s"] == pytest.approx(4 * shared["tokens_per_s"])
    per_token_target_s = {n: row["step_ms"] for n, row in ((1, alone), (4, shared))}
    assert shared["api_cost_usd_per_mtok"] == pytest.approx(alone["api_cost_usd_per_mtok"] * 0.30 / 0.15 / 4)
    assert "4 clients" in shared["label"] and per_token_target_s[4] > per_token_target_s[1]


def test_profile_grid_measures_batches(tiny_target):
    from specbench.decode.profile import forward_latency_grid

    rows = forward_latency_grid(tiny_target.model, tokens=[1, 3], contexts=[8], repeats=1, warmup=0, batches=[1, 3])
    assert [(r["batch"], r["tokens"]) for r in rows] == [(1, 1), (1, 3), (3, 1), (3, 3)]
    assert all(r["median_s"] > 0 for r in rows)


def test_profile_grid_warms_its_first_point_longer(tiny_target):
    """The grid's first point runs warmup + (warmup + repeats) untimed forwards before its timed ones (a
    worker's first forwards can run cold); every later point runs warmup."""
    from specbench.decode.profile import forward_latency_grid

    widths = []
    hook = tiny_target.model.register_forward_hook(lambda module, args, kwargs, out: widths.append(
        kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        forward_latency_grid(tiny_target.model, tokens=[1, 3], contexts=[8], repeats=2, warmup=1)
    finally:
        hook.remove()
    assert widths == [8] + [1] * (1 + 3 + 2) + [3] * (1 + 2)  # the prefill, then each point's forwards


def two_prompts():
    """Measured steps of two prompts: prompt 0 (context 10) a 4-token draft, 3 accepted (4 emitted),
    then a plain step (1 emitted); prompt 1 (context 20) one 0-draft step. 0.01 s per step on the client."""
    import pandas as pd

    return pd.DataFrame([
        {"prompt_index": 0, "step": 0, "drafted": 4, "emitted": 4, "draft_s": 0.008, "overhead_s": 0.002},
        {"prompt_index": 0, "step": 1, "drafted": 0, "emitted": 1, "draft_s": 0.0, "overhead_s": 0.01},
        {"prompt_index": 1, "step": 0, "drafted": 0, "emitted": 1, "draft_s": 0.0, "overhead_s": 0.01}])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_speed_prices_each_measured_step_at_the_batch_size_and_width(packed):
    from specbench.plan.replay import replay_speed

    records = two_prompts()
    # Alone, each step is priced at its own width: 5 tokens -> 0.15 s, 1 token -> 0.10 s.
    alone = 6 / (0.15 + 2 * 0.10 + 3 * 0.01)
    assert replay_speed(records, [10, 20], SHARED, clients=1, packed=packed) == pytest.approx(alone)
    if packed:
        # At 4 clients the others' rows are 7/3 tokens on average: the 5-token step's batch is
        # (5 + 3 * 7/3) / 4 = 3 tokens a row -> 0.25 s; a 1-token step's (1 + 7) / 4 = 2 -> 0.225 s.
        expected_4 = 6 / (0.25 + 2 * 0.225 + 3 * (0.01 + 0.002))
        assert replay_speed(records, [10, 20], SHARED, clients=4, network_s=0.002) == pytest.approx(expected_4)
        return
    # At 4 clients: 5 tokens -> 0.30 s, 1 token -> 0.20 s; a 1-token step shares its batch with 3 other
    # rows, each 5 wide with probability 1/3, so it is padded to 5 with probability 1 - (2/3)^3 = 19/27.
    one_wide = 19 / 27 * 0.30 + 8 / 27 * 0.20
    expected_4 = 6 / (0.30 + 2 * one_wide + 3 * (0.01 + 0.002))
    assert replay_speed(records, [10, 20], SHARED, clients=4, network_s=0.002, packed=False) == pytest.approx(expected_4)
    at_2 = (0.10 + (0.20 - 0.10) / 3, 0.15 + (0.30 - 0.15) / 3)  # (1 token, 5 tokens), linear in batch 1..4
    one_wide_2 = 1 / 3 * at_2[1] + 2 / 3 * at_2[0]
    expected_2 = 6 / (at_2[1] + 2 * one_wide_2 + 3 * 0.01)
    assert replay_speed(records, [10, 20], SHARED, clients=2, packed=False) == pytest.approx(expected_2)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_together_runs_rounds_until_the_last_client_ends(packed):
    from specbench.plan.replay import replay_speed, replay_together

    records = two_prompts()
    # Round 0: both clients, rows of 5 and 1 tokens, batch 2. Packed: 3 tokens a row, 0.125 s at batch 1
    # and 0.25 s at batch 4 -> 0.1667 s at batch 2; padded: 5 tokens a row, 0.15 / 0.30 -> 0.20 s.
    # Round 1: prompt 0 alone (a part-full batch), 1 token at batch 1: 0.10 s.
    first = 0.125 + (0.25 - 0.125) / 3 if packed else 0.20
    expected = 6 / (first + 0.10 + 2 * (0.01 + 0.002))
    assert replay_together(records, [10, 20], SHARED, network_s=0.002, packed=packed) == pytest.approx(expected)
    # One client together is that client alone.
    one = records[records["prompt_index"] == 0]
    assert replay_together(one, [10, 20], SHARED, packed=packed) == pytest.approx(
        replay_speed(one, [10, 20], SHARED, clients=1, packed=packed))


def test_prompt_run_steps_without_a_match_verify_one_token_and_accept_none():
    """`chain_hits`: the share of prompt-lookup steps that found a K-token chain; the rest verify the bonus
    alone, so tokens per step and the verify's cost are priced with that share, not the matched steps' own."""
    from specbench.plan.predict import AcceptanceReference, OperatingPoint, predict_step

    matched = AcceptanceReference("prompt-lookup", "t", "d", max_chain=4, chain_accepts=(4, 2, 0, 2))
    partly = dataclasses.replace(matched, chain_hits={4: 0.25})
    point = OperatingPoint("prompt-lookup", k=4)
    full, quarter = (predict_step(point, SHARED, None, ref, context=256) for ref in (matched, partly))
    assert full.tokens_per_step == pytest.approx(1 + 2.0) and quarter.tokens_per_step == pytest.approx(1 + 0.5)
    assert full.verify_s == pytest.approx(SHARED.forward_s(5, 256))
    assert quarter.verify_s == pytest.approx(0.25 * SHARED.forward_s(5, 256) + 0.75 * SHARED.forward_s(1, 256))
    assert partly.hit_rate(2) == 0.25 and matched.hit_rate(4) == 1.0  # an unknown K: the longest measured


def test_prompt_lookups_partial_matches_are_priced_at_their_own_widths(tmp_path):
    """`steps_at_k`: prompt lookup's (drafted, accepted) per step. A partial match verifies 1 + drafted tokens
    and may be accepted; pricing it as a miss (width 1, nothing accepted) made every lookup point look cheaper
    per step than it ran (humaneval K=6, 2026-11-26: 46% full matches, 24% partial, priced 98.6 ms a step where
    its steps took 112). A smaller K copies the same match's first K tokens: its steps follow from a larger K's.
    The steps survive a save and load."""
    from specbench.plan.library import load_references, save_reference
    from specbench.plan.predict import AcceptanceReference, OperatingPoint, predict_step

    steps = ((0, 0), (2, 2), (4, 1), (4, 4))
    reference = AcceptanceReference("prompt-lookup", "t", "d", max_chain=4, chain_accepts=(1, 4),
                                    chain_hits={4: 0.5}, steps_at_k={4: steps})
    at4 = predict_step(OperatingPoint("prompt-lookup", k=4), SHARED, None, reference, context=256)
    assert at4.tokens_per_step == pytest.approx(1 + 7 / 4)
    f = lambda width: SHARED.forward_s(width, 256)  # noqa: E731
    assert at4.verify_s == pytest.approx((f(1) + f(3) + 2 * f(5)) / 4)
    at2 = predict_step(OperatingPoint("prompt-lookup", k=2), SHARED, None, reference, context=256)
    assert reference.steps_at(2) == ((0, 0), (2, 2), (2, 1), (2, 2))
    assert at2.tokens_per_step == pytest.approx(1 + 5 / 4) and at2.verify_s == pytest.approx((f(1) + 3 * f(3)) / 4)
    assert reference.steps_at(6) == ()  # above what was recorded: the hit share prices it, as before
    hits_only = dataclasses.replace(reference, steps_at_k={})
    assert predict_step(OperatingPoint("prompt-lookup", k=4), SHARED, None, hits_only, context=256).verify_s == \
        pytest.approx(0.5 * f(5) + 0.5 * f(1))
    save_reference(reference, folder=tmp_path)
    assert load_references(tmp_path)[0].steps_at_k == {4: steps}



def test_a_free_drafts_tree_is_priced_by_every_step_it_ran_not_by_its_full_trees(tmp_path):
    """Suffix decoding's and prompt lookup's trees draft what they find, none on most steps of new text. Priced by
    their full trees alone, as a model draft's trees are, a tune once predicted suffix decoding's 6-node tree at
    96.6 tok/s (4.33 tokens a step over 12 full trees of 14 prompts) where it ran 32.7 (1.42): every step of the run
    is kept (`tree_steps`), priced at its own width (1 + nodes), its family's steps its own, and saved."""
    from specbench.plan.library import load_references, save_reference
    from specbench.plan.predict import AcceptanceReference, OperatingPoint, predict_step

    steps = ((0, 0), (0, 0), (3, 1), (6, 5))
    full = AcceptanceReference("suffix", "t", "d", max_chain=4, tree_accepts={6: (5,)}, tree_prompts={6: (1,)},
                               tree_depth={6: 5.0}, tree_width={6: 1}, prompt_families=("a", "b"))
    every = dataclasses.replace(full, tree_steps={6: steps}, tree_steps_prompts={6: (0, 1, 0, 1)})
    point = OperatingPoint("suffix-tree", k=6)
    f = lambda width: SHARED.forward_s(width, 256)  # noqa: E731
    old, new = (predict_step(point, SHARED, None, ref, context=256) for ref in (full, every))
    assert old.tokens_per_step == pytest.approx(6.0)  # the full tree's, as if every step grew one
    assert new.tokens_per_step == pytest.approx(1 + 6 / 4) and new.draft_s == 0.0
    assert new.verify_s == pytest.approx((2 * f(1) + f(4) + f(7)) / 4)
    family = every.for_family("b")
    assert family.tree_steps == {6: ((0, 0), (6, 5))} and family.tree_steps_prompts == {6: (1, 1)}
    save_reference(every, folder=tmp_path)
    assert load_references(tmp_path)[0].tree_steps == {6: steps}

def test_a_server_prices_suffix_decoding_from_its_own_reference_not_prompt_lookups(monkeypatch):
    """`predicted_settings`: each lookup method from its own steps (suffix decoding drafts otherwise than
    prompt lookup); without a suffix reference the setting is named as not covered, not priced as lookup."""
    from specbench.plan import library
    from specbench.plan.predict import AcceptanceReference
    from specbench.serve.prediction import predicted_settings

    lookup = AcceptanceReference("prompt-lookup", "t", "d", max_chain=4, steps_at_k={4: ((0, 0), (4, 4))})
    suffix = AcceptanceReference("suffix", "t", "d", max_chain=4, steps_at_k={4: ((2, 2), (4, 1))})
    monkeypatch.setattr(library, "load_library", lambda: ([SHARED], [lookup, suffix]))
    both = predicted_settings("t", None, ["prompt-lookup", "suffix"], [4])
    f = lambda width: SHARED.forward_s(width, 256)  # noqa: E731
    assert both["prompt-lookup k=4"]["tokens_per_s"] == pytest.approx((1 + 2) / ((f(1) + f(5)) / 2), abs=0.01)
    assert both["suffix k=4"]["tokens_per_s"] == pytest.approx((1 + 1.5) / ((f(3) + f(5)) / 2), abs=0.01)
    monkeypatch.setattr(library, "load_library", lambda: ([SHARED], [lookup]))
    assert "missing" in predicted_settings("t", None, ["suffix"], [4])["suffix k=4"]


def test_a_servers_predictions_read_its_targets_device_first_and_say_when_another_device_was_profiled(monkeypatch):
    """A server on a GPU once priced its settings from this CPU's profile and showed it unremarked; now the
    served target's device is read first, and a prediction from another device says so (`here`)."""
    from dataclasses import replace

    from specbench.plan import library
    from specbench.serve.prediction import predicted_settings

    gpu = replace(SHARED, device="NVIDIA-H100-80GB-HBM3",
                  rows=tuple((w, c, s / 10, b) for w, c, s, b in SHARED.rows))
    monkeypatch.setattr(library, "load_library", lambda: ([SHARED, gpu], []))
    on_gpu = predicted_settings("t", None, ["target-only"], [1], device=gpu.device)["target-only"]
    assert on_gpu["device"] == gpu.device and on_gpu["here"] is True
    assert on_gpu["tokens_per_s"] == pytest.approx(1 / gpu.forward_s(1, 256), rel=0.01)
    elsewhere = predicted_settings("t", None, ["target-only"], [1], device="NVIDIA-H200")["target-only"]
    assert elsewhere["here"] is False  # no profile on the served device: another's, said as such
    assert predicted_settings("t", None, ["target-only"], [1])["target-only"]["here"] is None  # device unknown
    # no profile of the device itself: the same CPU at another thread count before another CPU with a wider grid
    wide = replace(SHARED, device="cpu-2t-Other-CPU", rows=SHARED.rows + ((1, 256, 0.4, 8),))
    narrow = replace(SHARED, device="cpu-2t-Zen-avx512", rows=SHARED.rows[:2])
    monkeypatch.setattr(library, "load_library", lambda: ([wide, narrow], []))
    one_thread = predicted_settings("t", None, ["target-only"], [1], device="cpu-1t-Zen-avx512")["target-only"]
    assert one_thread["device"] == narrow.device and one_thread["here"] is False
    gpu_wide = replace(gpu, rows=wide.rows)  # a GPU's profile with the widest grid: still after any CPU's
    monkeypatch.setattr(library, "load_library", lambda: ([gpu_wide, narrow], []))
    assert predicted_settings("t", None, ["target-only"], [1], device="cpu-2t-Other")["target-only"]["device"] == \
        narrow.device


def test_replay_together_adds_the_workers_own_work_per_round_and_can_keep_the_measured_verifies():
    """`HostCost`: a worker's own work per round (fixed + per row) is added to every round at its rows;
    with `alone_verifies`, records of a run through the same worker keep their measured server time and
    swap only the lone forward for the batched one, so one client reproduces its own run exactly."""
    from specbench.plan.predict import HostCost
    from specbench.plan.replay import replay_together

    records = two_prompts()
    host = HostCost(fixed_s=0.001, row_s=0.0005)
    plain = 6 / replay_together(records, [10, 20], SHARED, network_s=0.002)
    # round 0 has 2 rows, round 1 one row
    assert 6 / replay_together(records, [10, 20], SHARED, network_s=0.002, host=host) == pytest.approx(
        plain + host.at(2) + host.at(1))
    assert HostCost.from_stats({"host_fixed_s": 0.001, "host_row_s": None}) == HostCost(0.001, 0.0)
    assert host.beyond_one().at(1) == pytest.approx(0) and host.beyond_one().at(3) == pytest.approx(0.001)
    measured = records.assign(queue_s=[0.001, 0.002, 0.0], verify_s=[0.17, 0.12, 0.11])
    one = measured[measured["prompt_index"] == 0]
    step_s = (one["draft_s"] + one["overhead_s"] + one["queue_s"] + one["verify_s"] + 0.002).sum()
    assert replay_together(one, [10, 20], SHARED, network_s=0.002, host=host.beyond_one(),
                           alone_verifies=True) == pytest.approx(5 / step_s)
    # together: round 0's server time is the slower row's measured one, less its lone forward, plus the batch's
    first = max(0.001 + 0.17 - SHARED.forward_s(5, 10, 1), 0.0 + 0.11 - SHARED.forward_s(1, 20, 1))
    rounds = (first + SHARED.forward_s(3, 15, 2) + host.beyond_one().at(2) + 0.01 + 0.002
              + 0.002 + 0.12 + 0.01 + 0.002)
    assert 6 / replay_together(measured, [10, 20], SHARED, network_s=0.002, host=host.beyond_one(),
                               alone_verifies=True) == pytest.approx(rounds)


def test_replay_speed_under_steady_load_pays_every_clients_prefills():
    """Prompt after prompt on a shared target: per prompt, a client waits for its own prefill and, on
    average, every other client's one (each blocks the target), plus a round trip to open and one to close."""
    from specbench.plan.replay import replay_speed

    records = two_prompts().assign(prefill_s=[0.05, 0.05, 0.07])  # per prompt, on every row of its steps
    decode_only = replay_speed(records, [10, 20], SHARED, clients=4, network_s=0.002)
    seconds = 6 / decode_only + 4 * (0.05 + 0.07) + 2 * 2 * 0.002
    steady = replay_speed(records, [10, 20], SHARED, clients=4, network_s=0.002, prefills=True)
    assert steady == pytest.approx(6 / seconds)
    with pytest.raises(ValueError, match="prefill_s"):
        replay_speed(two_prompts(), [10, 20], SHARED, prefills=True)
