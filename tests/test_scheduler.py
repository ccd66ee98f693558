"""Fairness on a shared worker: long requests (prefill, server-only generate, profile) run a slice
at a time between other clients' batches, and give what they give when run in one go."""
import time

import numpy as np
import pytest
import torch

from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.types import DraftTree, SamplingParams
from specbench.worker import protocol
from specbench.worker.client import RemoteTarget

from conftest import PROMPTS
from worker_helpers import RawClient, decode_in_process, forked, process_worker

LONG_PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 96, 480)]


def greedy_alone(loaded, prompt, max_new_tokens):
    return generate(LocalTarget(loaded), None, prompt, Decoding(0, max_new_tokens, kind="none")).output_ids


@pytest.mark.parametrize("chunk", [1, 7, 32, 479])
def test_chunked_prefill_equals_one_forward(tiny_target, chunk):
    """Chunks through one cache give the keys and values of one forward (causal attention), up to
    rounding; the greedy continuation is the same token for token."""
    one, chunked = LocalTarget(tiny_target), LocalTarget(tiny_target)
    one.prefill("s", LONG_PROMPT)
    job, slices = chunked.prefill_job("s", LONG_PROMPT), 1
    while not job.advance(chunk):
        slices += 1
        assert "s" not in chunked.sessions, "a session must not be usable before its last chunk"
    assert slices == -(-(len(LONG_PROMPT) - 1) // chunk)
    for (k1, v1), (k2, v2) in zip(layers(one.sessions["s"].cache), layers(chunked.sessions["s"].cache)):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-4)
    for _ in range(24):
        a = one.verify("s", DraftTree(), SamplingParams(), 0)
        b = chunked.verify("s", DraftTree(), SamplingParams(), 0)
        assert a.bonus_token == b.bonus_token


def layers(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_resent_prefill_joins_and_newer_one_supersedes():
    """A resend of a prefill under way gets the same reply (applied once); a newer prefill of the
    session ends the older one with `stale-step`; a close ends it with `cancelled`."""
    with process_worker("--slice-tokens", "1") as worker:
        client = RawClient(worker.endpoint)
        tokens = {"tokens": np.asarray(LONG_PROMPT, np.int32)}
        client.send({"op": "prefill", "session": "a", "epoch": 1, "id": 1}, tokens)
        client.send({"op": "prefill", "session": "a", "epoch": 1, "id": 2}, tokens)
        replies = sorted((client.receive(30)[0] for _ in range(2)), key=lambda r: r["id"])
        assert [r["ok"] for r in replies] == [True, True], replies
        assert [r["committed"] for r in replies] == [480, 480] and [r["epoch"] for r in replies] == [1, 1]

        client.send({"op": "prefill", "session": "a", "epoch": 2, "id": 3}, tokens)
        client.send({"op": "prefill", "session": "a", "epoch": 3, "id": 4}, {"tokens": np.asarray(PROMPTS[0], np.int32)})
        replies = sorted((client.receive(30)[0] for _ in range(2)), key=lambda r: r["id"])
        assert replies[0]["code"] == "stale-step" and "superseded" in replies[0]["error"], replies[0]
        assert replies[1]["ok"] and replies[1]["committed"] == len(PROMPTS[0]), replies[1]
        verify = {"op": "verify", "session": "a", "epoch": 3, "committed": len(PROMPTS[0]), "seed": 0,
                  "sampling": {"temperature": 0.0}, "id": 5}
        reply, _ = client.request(verify, protocol.tree_to_arrays(DraftTree()))
        assert reply["ok"] and reply["committed"] == len(PROMPTS[0]) + 1, reply

        client.send({"op": "prefill", "session": "b", "epoch": 1, "id": 6}, tokens)
        client.send({"op": "close", "session": "b", "id": 7})
        replies = {r["id"]: r for r in (client.receive(30)[0] for _ in range(2))}
        assert replies[7]["ok"] and replies[6]["code"] == "cancelled", replies
        assert client.request({"op": "stats"})[0]["sessions"] == 1  # "a" only: "b" left nothing behind


@pytest.mark.serial  # times how long one tenant waits for another
def test_eight_clients_keep_stepping_through_long_requests(tiny_target, tiny_draft):
    """Seven client processes decode while an eighth sends a 480-token prompt and a 150-token
    server-only generate: the seven's steps keep completing during both (a slice at a time, prefill
    chunks also riding in their verify batches), and every output, the long ones included, equals the
    same prompt run alone."""
    context = forked()
    with process_worker("--slice-tokens", "8") as worker:
        ready, go, results = [context.Event() for _ in range(7)], context.Event(), context.Queue()
        prompts = [PROMPTS[i % len(PROMPTS)][: 4 + i % 4] for i in range(7)]
        clients = [context.Process(target=decode_in_process,
                                   args=(worker.endpoint, prompts[i], 240, "chain" if i % 2 else "target-only",
                                         ready[i], go, results)) for i in range(7)]
        for client in clients:
            client.start()
        for event in ready:
            assert event.wait(180), "a client process did not start"
        remote = RemoteTarget(worker.endpoint, timeout_s=120)
        go.set()
        time.sleep(0.5)  # the seven are stepping
        started = time.time()
        long = generate(remote, None, LONG_PROMPT, Decoding(0, 20, kind="none"), session="long")
        prefill_window = (started, started + long.prefill_s)
        started = time.time()
        server_only = remote.generate_on_worker("server-only-ar", PROMPTS[0], k=1, max_new_tokens=150,
                                                sampling=SamplingParams(), seed=0)
        generate_window = (started, time.time())
        finished = [results.get(timeout=300) for _ in clients]
        for client in clients:
            client.join(30)
        stats = remote.stats()
        batched_prefill, busy = stats["prefill_tokens_batched"], stats["busy_s"]

    during_prefill = sum(prefill_window[0] < t < prefill_window[1] for *_, stamps in finished for t in stamps)
    during_generate = sum(generate_window[0] < t < generate_window[1] for *_, stamps in finished for t in stamps)
    longest_gap = max(b - a for *_, stamps in finished for a, b in zip(stamps, stamps[1:]))
    print(f"\nother clients' steps during the 480-token prefill ({long.prefill_s:.2f} s): {during_prefill}; "
          f"during the 150-token generate ({generate_window[1] - generate_window[0]:.2f} s): {during_generate}; "
          f"longest wait between two steps of a client: {longest_gap:.2f} s")
    assert during_prefill >= 20 and during_generate >= 50, "long requests held the other clients"
    assert batched_prefill > 0, "no prefill chunk rode in the others' verify batches"
    # the worker's compute time, per op: the generate's slices fit inside its window, all of it in the uptime
    assert busy["verify"] > 0 and busy["prefill"] > 0, busy
    assert 0 < busy["generate"] < generate_window[1] - generate_window[0], busy
    assert sum(busy.values()) < stats["uptime_s"], busy
    assert longest_gap < 10.0
    for prompt, method, output, _ in finished:
        assert output == greedy_alone(tiny_target, prompt, 240), (prompt, method)
    assert long.output_ids == greedy_alone(tiny_target, LONG_PROMPT, 20)
    assert server_only.output_ids == greedy_alone(tiny_target, PROMPTS[0], 150)


def test_a_clients_long_requests_count_against_its_quota():
    """Generates and profiles under way count against --max-sessions-per-client: one client cannot
    queue enough of them to take every slice between the other clients' rounds."""
    with process_worker("--max-sessions-per-client", "2") as worker:
        client, other = RawClient(worker.endpoint), RawClient(worker.endpoint)
        generate = {"op": "generate", "method": "server-only-ar", "max_new_tokens": 400,
                    "sampling": {"temperature": 0.0}}
        prompt = {"tokens": np.asarray(PROMPTS[0], np.int32)}
        for request_id in range(3):
            client.send(dict(generate, id=request_id), prompt)
        replies = sorted((client.receive(60)[0] for _ in range(3)), key=lambda r: r["id"])
        assert [r["ok"] for r in replies[:2]] == [True, True], replies
        assert replies[2]["code"] == "limit" and "--max-sessions-per-client" in replies[2]["error"], replies[2]
        assert other.request(dict(generate, max_new_tokens=4), prompt, timeout_s=60)[0]["ok"]  # its own quota


@pytest.mark.serial  # times a wait
@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
def test_queue_time_counts_the_wait_behind_a_running_request(batching):
    """A request that arrives while the worker computes is read and time-stamped on arrival (by the
    worker's I/O thread), so its wait shows in the reply's `queue_s` and in `worker_s`, not in what
    the client would book as network time. Before, it waited unread and its queue_s was ~0 (and
    replies of a `--no-batching` worker carried none). The computing is a request of this test's own
    (`busy`: a second of work that releases the GIL, as a forward does): since slices are bounded, no
    request a client may send holds a worker that long in one piece."""
    from worker_helpers import ThreadWorker

    thread_worker = ThreadWorker(batching=batching)
    thread_worker.worker.ops.handlers["busy"] = lambda header, arrays, **_: (time.sleep(1.0), ({}, None))[1]
    try:
        busy, client = RawClient(thread_worker.endpoint), RawClient(thread_worker.endpoint)
        prefill = {"op": "prefill", "session": "s", "epoch": 1}
        assert client.request(prefill, {"tokens": np.asarray(PROMPTS[0], np.int32)})[0]["ok"]
        busy.send({"op": "busy"})
        time.sleep(0.1)  # the worker is computing now
        verify = {"op": "verify", "session": "s", "epoch": 1, "committed": len(PROMPTS[0]), "seed": 0,
                  "sampling": {"temperature": 0.0}}
        sent = time.perf_counter()
        reply, _ = client.request(verify, protocol.tree_to_arrays(DraftTree()), timeout_s=60)
        round_trip = time.perf_counter() - sent
        assert reply["ok"], reply
        assert reply["queue_s"] > 0.4 * (1.0 - 0.1), reply
        assert round_trip - reply["worker_s"] < 0.2, (round_trip, reply["worker_s"])
        assert busy.receive(60)[0]["ok"]
    finally:
        thread_worker.stop()


def test_opening_and_closing_other_sessions_do_not_split_a_batch():
    """Under steady load clients close a finished prompt's session and open the next one every few
    steps; those requests, arriving among other sessions' verifies, are handled beside the batch (one
    forward for all the verifies), while a close of a session with a step in the batch still waits for
    that step. Before, each split the batch in two forwards."""
    from specbench.models.spec import ModelSpec
    from specbench.worker.inbox import Message
    from specbench.worker.server import Worker, WorkerConfig

    worker = Worker(WorkerConfig(model=ModelSpec("tiny-random:seed=0")), log=lambda line: None)
    lone = LocalTarget(worker.ops.target.loaded, kv_pool=False)

    def message(header, arrays=None):
        return Message(b"c", [], protocol.encode(dict({"client": "a-client-of-the-test"}, **header), arrays))

    def prefill(name, prompt):
        return message({"op": "prefill", "session": name, "epoch": 1}, {"tokens": np.asarray(prompt, np.int32)})

    def verify(name, committed):
        return message({"op": "verify", "session": name, "epoch": 1, "committed": committed, "seed": 0,
                        "sampling": {"temperature": 0.0}}, protocol.tree_to_arrays(DraftTree()))

    for name, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1]), ("done", PROMPTS[2])):
        assert protocol.decode(worker.handle(prefill(name, prompt).frames))[0]["ok"]
        lone.prefill(name, prompt)
    messages = [verify("a", len(PROMPTS[0])), message({"op": "close", "session": "done"}),
                prefill("next", PROMPTS[3]), verify("next", len(PROMPTS[3])), message({"op": "health"}),
                verify("b", len(PROMPTS[1]))]
    replies = {id(m): protocol.decode(frames)[0] for m, frames in worker.handle_many(messages)}
    batched = [replies[id(messages[i])] for i in (0, 3, 5)]
    # the new session's prefill ran when it came (a short one in one slice), so its verify, sent right
    # behind it in the same round, joined the batch
    assert [r["batch_size"] for r in batched] == [3, 3, 3], batched
    lone.prefill("next", PROMPTS[3])
    for reply, name in zip(batched, ("a", "next", "b")):
        assert reply["bonus"] == lone.verify(name, DraftTree(), SamplingParams(), 0).bonus_token
    assert all(replies[id(messages[i])]["ok"] for i in (1, 2, 4)), replies
    assert replies[id(messages[2])]["committed"] == len(PROMPTS[3])
    assert {name for _, name in worker.ops.sessions.sessions} == {"a", "b", "next"}  # "done" closed

    # a close of a session whose step is in the batch runs after that step: two batches of one
    messages = [verify("a", len(PROMPTS[0]) + 1), message({"op": "close", "session": "a"}),
                verify("b", len(PROMPTS[1]) + 1)]
    replies = [protocol.decode(frames)[0] for _, frames in worker.handle_many(messages)]
    assert [r.get("batch_size") for r in replies] == [1, None, 1], replies
    assert all(r["ok"] for r in replies), replies


def step_with_think_time(endpoint: str, name: str, prompt: list, think_s: float, steps: int, out: dict) -> None:
    """A client that takes `think_s` between a reply and its next verify (drafting on its own device):
    records each reply's batch size and bonus token."""
    client, committed, sizes, tokens = RawClient(endpoint), len(prompt), [], []
    try:
        assert client.request({"op": "prefill", "session": name, "epoch": 1},
                              {"tokens": np.asarray(prompt, np.int32)}, timeout_s=60)[0]["ok"]
        for _ in range(steps):
            reply, _ = client.request({"op": "verify", "session": name, "epoch": 1, "committed": committed,
                                       "seed": 0, "sampling": {"temperature": 0.0}},
                                      protocol.tree_to_arrays(DraftTree()), timeout_s=60)
            assert reply["ok"], reply
            committed = reply["committed"]
            sizes.append(reply["batch_size"])
            tokens.append(reply["bonus"])
            time.sleep(think_s)
        out[name] = (sizes, tokens)
    finally:
        client.close()


@pytest.mark.serial  # clients come back on a clock
@pytest.mark.parametrize("wait_ms", [400, 0], ids=["awaits-drafting-clients", "fixed-window"])
def test_a_batch_waits_for_clients_expected_back(tiny_target, wait_ms):
    """Clients that draft between steps come back each after its own time (here 60-240 ms apart, far
    over the 20 ms window). A worker that learns each session's turnaround (reply to next verify)
    waits for the sessions expected back within `--batch-wait-ms` and verifies them in one forward;
    with only the fixed window (`--batch-wait-ms 0`, the old rule) every client's step runs alone.
    The tokens are the same either way."""
    import threading

    steps, think = 12, (0.06, 0.12, 0.18, 0.24)
    with process_worker("--batch-wait-ms", str(wait_ms)) as worker:
        out = {}
        threads = [threading.Thread(target=step_with_think_time,
                                    args=(worker.endpoint, f"c{i}", PROMPTS[i], think[i], steps, out))
                   for i in range(len(think))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(out) == [f"c{i}" for i in range(len(think))], "a client failed: see its assertion above"
        stats = RawClient(worker.endpoint).request({"op": "stats"})[0]
    settled = [size for sizes, _ in out.values() for size in sizes[steps // 2:]]  # turnarounds learnt
    mean = sum(settled) / len(settled)
    if wait_ms:
        assert mean >= 3.5, (mean, out)
        assert stats["batch_wait_s"] > 0.1 * steps, stats  # ~the slowest client's think time per step
    else:
        assert mean <= 1.8, (mean, out)
    lone = LocalTarget(tiny_target)
    for i in range(len(think)):
        lone.prefill(f"c{i}", PROMPTS[i])
        assert out[f"c{i}"][1] == [lone.verify(f"c{i}", DraftTree(), SamplingParams(), 0).bonus_token
                                   for _ in range(steps)]
