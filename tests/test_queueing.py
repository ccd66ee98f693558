"""Clients sharing a batching worker, simulated (`plan/queueing.py`), against timelines worked by hand."""
import pytest

from specbench.plan.predict import HostCost
from specbench.plan.queueing import ClientPrompt, ClientStep, WorkerRules, simulate
from specbench.tune.loaded import deal


def steps(*thinks, width=1, emitted=1):
    return tuple(ClientStep(think, width, emitted, 10) for think in thinks)


def test_one_client_pays_its_own_time_the_forward_and_the_host_work():
    """Prefill alone (0.3 s), then each step: think, forward 0.1 + 0.01 x width, host 0.001 + 0.002 per row."""
    prompt = ClientPrompt(10, 0.3, (ClientStep(0.05, 3, 2, 10), ClientStep(0.07, 3, 3, 12)))
    rules = WorkerRules(lambda width, context, rows: 0.1 * rows + 0.01 * width, HostCost(0.001, 0.002))
    out = simulate([[prompt]], rules)
    assert out.rows == [1, 1] and out.queue_s == [0.0, 0.0]
    assert out.step_s == pytest.approx(0.05 + 0.133 + 0.07 + 0.133)
    assert out.tokens == 5 and out.seconds == pytest.approx(0.3 + 0.05 + 0.133 + 0.07 + 0.133)


def test_clients_in_step_share_every_forward():
    prompt = ClientPrompt(10, 0.3, steps(0.05, 0.05, width=3, emitted=2))
    rules = WorkerRules(lambda width, context, rows: 0.1 * rows + 0.01 * width, HostCost(0.001, 0.002))
    out = simulate([[prompt], [prompt]], rules)
    assert out.rows == [2, 2]  # both prefills ran in one slice (0.6 s), so both steps arrive together
    assert out.tokens_per_s == pytest.approx(8 / (4 * (0.05 + 0.23 + 0.005)))


def test_a_client_that_arrives_while_the_worker_is_busy_queues():
    """A forward takes 1 s. A sends at once, B after 0.5 s: A runs alone (0-1), B waits 0.5 s and then shares
    A's second step (1-2), then B's second step runs alone (2.5-3.5)."""
    rules = WorkerRules(lambda width, context, rows: 1.0, window_s=0.0)
    out = simulate([[ClientPrompt(1, 0.0, steps(0.0, 0.0))], [ClientPrompt(1, 0.0, steps(0.5, 0.5))]], rules)
    assert out.rows == [1, 2, 1] and out.queue_s == pytest.approx([0.0, 0.5, 0.0, 0.0])
    assert out.step_s == pytest.approx(2.0 + 3.5) and out.seconds == pytest.approx(3.5)


def test_the_worker_waits_for_a_session_expected_back_within_its_cap():
    """A comes back 0.1 s after a reply, B 0.3 s after. Without a wait cap A's step runs without B's, and they
    stay apart (every round one row, each step queued 0.7-0.9 s); with a 0.5 s cap, once both turnarounds are
    known (after three lone rounds) the worker holds each batch for B, until A has finished its steps."""
    def run(cap):
        clients = [[ClientPrompt(1, 0.0, steps(*[0.1] * 6))], [ClientPrompt(1, 0.0, steps(*[0.3] * 6))]]
        return simulate(clients, WorkerRules(lambda width, context, rows: 1.0, window_s=0.0, wait_cap_s=cap))

    apart, held = run(0.0), run(0.5)
    assert apart.rows == [1] * 12 and held.rows == [1, 1, 1, 2, 2, 2, 2, 1]
    assert held.tokens_per_s > apart.tokens_per_s


def test_a_prefill_rides_in_the_next_verify_round_up_to_its_slice():
    """B's 500-token prompt (0.01 s a token) and A's 10-token one arrive together: the first slice (256 tokens)
    feeds A's and 246 of B's alone (2.56 s); B's other 254 ride with A's first verify (1 + 2.54 s)."""
    a = ClientPrompt(10, 0.1, steps(0.0))
    b = ClientPrompt(500, 5.0, steps(0.0))
    out = simulate([[a], [b]], WorkerRules(lambda width, context, rows: 1.0, window_s=0.0))
    assert out.rows == [1, 1] and out.step_s == pytest.approx(3.54 + 1.0)
    assert out.seconds == pytest.approx(2.56 + 3.54 + 1.0)
    # the rounds' busy time holds the riding prefill, kept apart: a step's verify is priced without it
    assert out.busy_s == pytest.approx(2.0 + 2.54) and out.riding_s == pytest.approx(2.54)


def test_clients_are_dealt_the_prompts_as_a_loaded_tune_deals_them():
    assert [deal(5, 2, c) for c in range(2)] == [[0, 2, 4], [1, 3, 0]]
    assert [deal(4, 4, c) for c in range(4)] == [[0], [1], [2], [3]]


def test_the_wait_cap_is_the_workers_fitted_fixed_cost_else_the_profiles_bounded_by_a_lone_forward():
    from specbench.plan.predict import LatencyProfile
    from specbench.tune.loaded import worker_rules

    profile = LatencyProfile("t", "cpu", rows=((1, 64, 0.12), (3, 64, 0.16), (5, 64, 0.20), (1, 64, 0.2, 2)))
    assert worker_rules(profile, {}).wait_cap_s == pytest.approx(0.10)  # the line 0.10 + 0.02 per token
    assert worker_rules(profile, {"forward_fixed_s": 0.05, "host_fixed_s": 0.001}).wait_cap_s == pytest.approx(0.05)
    assert worker_rules(profile, {"forward_fixed_s": 0.5}).wait_cap_s == pytest.approx(0.12)
    assert worker_rules(profile, {"forward_fixed_s": 0.05, "host_fixed_s": 0.001}).host == HostCost(0.001, 0.0)


def test_a_one_client_run_replayed_alone_takes_its_own_time():
    """`from_records` + one client: each step's own time (drafting, loop, wire) and its forward (here the
    profile prices each width as the run took it) add up to the run's own steps, so its tokens/s come back."""
    import pandas as pd

    from specbench.tune.loaded import from_records, run_clients

    forward = {1: 0.04, 3: 0.07, 5: 0.06}
    rows = []
    for prompt in range(2):
        for step, drafted in enumerate([2, 4, 0, 4]):
            accepted = min(drafted, step)
            draft_s, overhead_s, network_s = 0.01 * drafted, 0.001, 0.002
            rows.append(dict(prompt_index=prompt, step=step, drafted=drafted, emitted=accepted + 1, draft_s=draft_s,
                             overhead_s=overhead_s, network_s=network_s, prompt_tokens=20 + prompt, prefill_s=0.3,
                             step_s=draft_s + overhead_s + network_s + forward[1 + drafted]))
    records = pd.DataFrame(rows)
    out = run_clients(from_records(records), 1, WorkerRules(lambda width, context, rows: forward[round(width)]))
    assert out.tokens == records["emitted"].sum() and out.rows == [1] * len(records)
    assert out.tokens_per_s == pytest.approx(records["emitted"].sum() / records["step_s"].sum())


def test_a_replayed_reference_gives_each_held_back_prompt_its_own_steps():
    """Steps at K keep their prompt (`steps_prompts`; a smaller K reads a larger one's); each becomes a client
    step: width 1 + drafted, emitted accepted + 1, its context growing, drafting scaled by what it drafted."""
    from specbench.plan.costs import StepCost
    from specbench.plan.reference import AcceptanceReference
    from specbench.tune.loaded import reference_prompts

    reference = AcceptanceReference("d", "t", "set", steps_at_k={4: ((4, 2), (4, 4), (2, 1))},
                                    steps_prompts={4: (0, 0, 1)})
    assert reference.prompts_at(2) == (0, 0, 1) and reference.steps_at(2) == ((2, 2), (2, 2), (2, 1))
    lone = StepCost(2.0, 0.3, 0.1, 0.002, 0.001, 0, 0)
    found = reference_prompts(reference, 4, lone, {0: (10, 0.5, 8), 1: (12, 0.4, 2)})
    assert [(s.width, s.emitted, s.context) for s in found[0].steps] == [(5, 3, 10), (5, 5, 13)]
    assert [(s.width, s.emitted, s.context) for s in found[1].steps] == [(3, 2, 12)]
    assert found[0].steps[0].think_s == pytest.approx(0.3 * 4 / (10 / 3) + 0.003)
    assert found[1].prefill_s == 0.4 and found[1].prompt_tokens == 12
