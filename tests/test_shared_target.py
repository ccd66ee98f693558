"""A worker shared by many clients batches their verifies, and every client gets what it gets alone."""
import threading

import pytest

from specbench.api import outputs, run
from specbench.types import SamplingParams
from specbench.worker.client import RemoteTarget

from conftest import PROMPTS
from worker_helpers import process_worker

PROMPT_SET = [PROMPTS[i % len(PROMPTS)][: 4 + i] for i in range(6)]


def clients_in_parallel(endpoint, draft, sampling, methods):
    """Six clients, each with its own RemoteTarget and prompt, all decoding at once."""
    results, errors = {}, []

    def client(index):
        try:
            remote = RemoteTarget(endpoint)
            results[index] = run(remote, [PROMPT_SET[index]], method=methods, draft=draft, k=3, max_new_tokens=20,
                                 sampling=sampling, seed=index, progress=False, warmup=False)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPT_SET))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, errors
    return results


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, rule="rejection")],
                         ids=["greedy", "rejection"])
@pytest.mark.parametrize("batching", [True, False], ids=["batched", "one-at-a-time"])
def test_concurrent_clients_get_what_they_get_alone(tiny_target, tiny_draft, sampling, batching):
    methods = ["target-only", "chain", "fixed-tree"] if sampling.greedy else ["target-only", "chain"]
    with process_worker(*([] if batching else ["--no-batching"])) as worker:
        results = clients_in_parallel(worker.endpoint, tiny_draft, sampling, methods)
        assert RemoteTarget(worker.endpoint).info["packed_batches"]  # what `replay_speed` prices them as
    sizes = []
    for index, records in results.items():
        alone = run(tiny_target, [PROMPT_SET[index]], method=methods, draft=tiny_draft, k=3, max_new_tokens=20,
                    sampling=sampling, seed=index, progress=False, warmup=False)
        assert outputs(records) == outputs(alone), index
        sizes += list(records["batch_size"])
    if batching:
        assert max(sizes) > 1, "no two verifies ever shared a forward: the test proves nothing"
    else:
        assert set(sizes) == {1}


def test_a_fast_worker_batches_its_clients_verifies(tiny_target, tiny_draft):
    """`--fast`: the clients' verifies share fixed-shape forwards over the static pool (batch sizes > 1),
    and each client gets what it gets alone on an eager target."""
    methods = ["target-only", "chain", "fixed-tree"]
    with process_worker("--fast", "static") as worker:
        results = clients_in_parallel(worker.endpoint, tiny_draft, SamplingParams(), methods)
        info = RemoteTarget(worker.endpoint).info
    assert info["kv_pool"]["slots"] >= 1 and not info["packed_batches"]  # padded to a bucket, priced so
    assert info["fast"]["backend"] == "static" and info["fast"]["batched"] > 0  # verifies shared a forward
    sizes = []
    for index, records in results.items():
        alone = run(tiny_target, [PROMPT_SET[index]], method=methods, draft=tiny_draft, k=3, max_new_tokens=20,
                    progress=False, warmup=False)
        assert outputs(records) == outputs(alone), index
        sizes += list(records["batch_size"])
    assert max(sizes) > 1, "no two verifies ever shared a forward: the test proves nothing"


def test_a_replayed_draft_proposes_what_the_draft_did_as_slowly_as_it_did(tiny_target, tiny_draft):
    """decode/replay_drafter.py, clients on other hosts (the tune's and the concurrency benchmark's): replaying the
    recorded proposals decodes step for step as the draft model does (same drafts, same verdicts,
    each step's drafting at least as long as recorded); a context never recorded is a counted miss
    whose output is still the target's."""
    from specbench.decode.drafters import ModelDrafter
    from specbench.decode.loop import Decoding, generate
    from specbench.decode.replay_drafter import ReplayDrafter, context_key, record
    from specbench.decode.target import LocalTarget

    target, decoding = LocalTarget(tiny_target), Decoding(3, 20, method="chain", kind="chain")
    drafter = lambda: ModelDrafter(tiny_draft, tiny_target.vocab_size)  # noqa: E731
    proposals = record(target, drafter(), PROMPT_SET[:2], decoding.k, decoding.max_new_tokens)
    for prompt in PROMPT_SET[:2]:
        real = generate(target, drafter(), prompt, decoding)
        replay = ReplayDrafter(proposals)
        got = generate(target, replay, prompt, decoding)
        assert replay.misses == 0 and got.output_ids == real.output_ids
        assert [(r.drafted, r.accepted) for r in got.records] == [(r.drafted, r.accepted) for r in real.records]
        recorded = [proposals[key][2] for key in _keys(prompt, got.records, decoding, context_key)]
        assert all(r.draft_s >= seconds for r, seconds in zip(got.records, recorded))
    replay = ReplayDrafter(proposals)
    other = [token + 1 for token in PROMPT_SET[0]]  # no recorded context starts with it
    got = generate(target, replay, other, decoding)
    assert replay.misses == sum(r.drafted for r in got.records) > 0  # a miss drafts one token
    median = sorted(found[2] for found in proposals.values())[len(proposals) // 2]
    assert replay.miss_s == median > 0 and all(r.draft_s >= median for r in got.records if r.drafted)  # as slowly
    assert got.output_ids == generate(target, None, other, Decoding(0, 20, kind="none")).output_ids
    # with the drafter to fall back on, a miss is drafted for real: step for step what the draft does alone
    replay = ReplayDrafter(proposals, fallback=drafter())
    got, real = generate(target, replay, other, decoding), generate(target, drafter(), other, decoding)
    assert replay.misses == len(got.records) > 0 and got.output_ids == real.output_ids
    assert [(r.drafted, r.accepted) for r in got.records] == [(r.drafted, r.accepted) for r in real.records]
    assert any(r.accepted > 0 for r in got.records)  # (one-token misses accepted nothing here)


def test_a_replayed_head_is_bound_and_drafts_its_misses_from_the_targets_features(tmp_path):
    """A draft head reads the target's session: the replay passes the loop's bind on, so the target keeps (a worker
    sends) its features as for the head alone, and a context never recorded is drafted by the head step for step
    as it drafts alone."""
    from specbench.api import outputs, run
    from specbench.decode.replay_drafter import ReplayDrafter
    from specbench.heads.build import new_head
    from specbench.heads.layouts import save_head
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    target = load_model(ModelSpec("tiny-random:seed=0"))
    folder = save_head(new_head(target, seed=3), tmp_path / "head")
    prompts = [list(p) for p in PROMPT_SET[:2]]
    job = dict(method="eagle", k=3, draft=str(folder), max_new_tokens=16, progress=False, warmup=False)
    replays = []

    def replayed(drafter):
        replays.append(ReplayDrafter({"never": ([1], [-1], 0.0, "")}, fallback=drafter))
        return replays[-1]

    alone, again = run(target, prompts, **job), run(target, prompts, **job, wrap_drafter=replayed)
    # every step that drafted was a miss (a step with one token left to emit drafts nothing)
    assert sum(r.misses for r in replays) == (again["drafted"] > 0).sum() > 0 and outputs(again) == outputs(alone)
    # the head's own chains of 3 (a one-token miss drafts 1); a random head accepts nothing on a random target
    assert again[["drafted", "accepted"]].values.tolist() == alone[["drafted", "accepted"]].values.tolist()
    assert again["drafted"].max() == 3


def test_a_trace_drafter_accepts_as_its_trace_says_and_the_output_stays_the_targets(tiny_target):
    """benchmarks' TraceDrafter (random-weight targets on a GPU): the target's own continuation for the trace's
    accepted length, then a token the target does not choose; off that continuation, all wrong (a miss)."""
    import sys
    from pathlib import Path

    from specbench.decode.loop import Decoding, generate
    from specbench.decode.target import LocalTarget

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from replay_draft import TraceDrafter

    target, prompt, k, accepts = LocalTarget(tiny_target), PROMPT_SET[3], 3, [2, 0, 4, 1, 3]
    alone = generate(target, None, prompt, Decoding(0, 24, kind="none")).output_ids
    drafter = TraceDrafter(prompt, alone, accepts, draft_s=0.001, vocab=tiny_target.vocab_size)
    got = generate(target, drafter, prompt, Decoding(k, 24, method="chain"))
    assert got.output_ids == alone and drafter.misses == 0
    full = [(i, r) for i, r in enumerate(got.records) if r.drafted == k]  # (the last steps are capped shorter)
    assert len(full) >= 5 and all(r.accepted == min(accepts[i % len(accepts)], k) for i, r in full)
    assert all(r.draft_s >= 0.001 for r in got.records if r.drafted)
    other = [token + 1 for token in prompt]
    missing = TraceDrafter(prompt, alone, accepts, draft_s=0.0, vocab=tiny_target.vocab_size)
    off = generate(target, missing, other, Decoding(k, 12, method="chain"))
    assert missing.misses == sum(r.drafted > 0 for r in off.records) > 0
    assert all(r.accepted == 0 for r in off.records if r.drafted)
    assert off.output_ids == generate(target, None, other, Decoding(0, 12, kind="none")).output_ids


def _keys(prompt, records, decoding, context_key):
    """The recorded proposals' keys of each step of a decode of `prompt` (the loop caps depth at what
    remains, less the bonus token)."""
    context = list(prompt)
    for record in records:
        remaining = decoding.max_new_tokens - (len(context) - len(prompt))
        yield context_key(context, decoding.k, remaining - 1)
        context += record.emitted_tokens


def test_the_worker_host_benchmark_splits_a_round_into_forward_and_the_rest():
    """benchmarks/worker_host.py: rounds of verifies from several sessions through an in-process worker, each
    split into the forward and the worker's own work; each round names the committed lengths the last one
    returned, so a reply that is not ok (a stale step) fails it."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from worker_host import measure

    args = argparse.Namespace(k=3, prompt_tokens=12, warmup=1, rounds=3)
    for fast in ("off", "static"):
        row = measure("tiny-random:seed=0", "cpu", fast, 3, args)
        assert row["rows"] == 3 and row["round_ms"] >= row["forward_ms"] > 0 and row["host_ms"] > 0
