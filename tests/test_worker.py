"""The remote target: identical results to local, faults, fuzzing, reconnects, auth, emulation."""
import itertools
import signal
import threading
import time

import pytest

from specbench.api import outputs, run
from specbench.decode.target import LocalTarget
from specbench.models.spec import ModelSpec
from specbench.models.tiny import tiny_model
from specbench.types import DraftTree, SamplingParams, SpecbenchError
from specbench.worker.client import NetworkEmulation, RemoteTarget, WorkerError, WorkerUnavailableError
from specbench.worker.protocol import is_local_endpoint
from specbench.worker.server import Worker, WorkerConfig

from conftest import PROMPTS
from worker_helpers import TARGET, ThreadWorker, forked, free_port, start_process_worker


@pytest.fixture(scope="module")
def worker():
    running = ThreadWorker()
    yield running
    running.stop()


def local_outputs(methods, sampling=SamplingParams(), max_new_tokens=24, prompts=PROMPTS):
    target, draft = tiny_model(0), tiny_model(1, noise_from=tiny_model(0), noise_scale=0.005)
    return outputs(run(target, prompts, method=methods, draft=draft, sampling=sampling,
                       max_new_tokens=max_new_tokens, progress=False))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, rule="rejection"),
                                      SamplingParams(temperature=0.8, top_p=0.9, rule="sample-match")],
                         ids=["greedy", "rejection", "sample-match"])
def test_remote_equals_local(worker, sampling):
    remote = RemoteTarget(worker.endpoint)
    draft = tiny_model(1, noise_from=tiny_model(0), noise_scale=0.005)
    methods = ["target-only", "chain", "prompt-lookup", "fixed-tree"]
    if sampling.effective_rule != "rejection":
        methods.append("tree")
    got = outputs(run(remote, PROMPTS, method=methods, draft=draft, sampling=sampling, max_new_tokens=24,
                      progress=False))
    # Step seeds travel with each verify, so even sampled runs match the local run token for token.
    assert got == local_outputs(methods, sampling)
    if sampling.effective_rule == "sample-match":  # the worker draws each position from the seed alone: one text
        for (method, index), ids in got.items():
            assert ids == got[("target-only", index)], method


def test_records_carry_wire_bytes_and_network_time(worker):
    remote = RemoteTarget(worker.endpoint, network=NetworkEmulation(rtt_ms=20))
    records = run(remote, PROMPTS[:1], method="prompt-lookup", max_new_tokens=10, progress=False, warmup=False)
    assert (records["bytes_up"] > 0).all() and (records["bytes_down"] > 0).all()
    assert (records["emulated_network_s"] >= 0.019).all()
    assert (records["network_s"] >= records["emulated_network_s"]).all()


def test_server_only_baselines_match_target_only(worker):
    remote = RemoteTarget(worker.endpoint)
    got = outputs(run(remote, PROMPTS, method=["server-only", "server-only-ar"], max_new_tokens=24, progress=False))
    reference = local_outputs(["target-only"])
    for index in range(len(PROMPTS)):
        assert got[("server-only", index)] == reference[("target-only", index)]
        assert got[("server-only-ar", index)] == reference[("target-only", index)]


def test_profile_and_stats(worker):
    remote = RemoteTarget(worker.endpoint)
    profile = remote.profile(tokens=[1, 4], contexts=[16], repeats=2)
    assert [(row["tokens"], row["context"]) for row in profile["rows"]] == [(1, 16), (4, 16)]
    assert all(row["median_s"] > 0 for row in profile["rows"])
    stats = remote.stats()
    assert stats["requests"] > 0 and remote.health()
    assert 0 < stats["busy_s"]["profile"] < stats["uptime_s"]


def test_a_batch_profile_times_packed_verifies_and_leaves_no_session(worker, monkeypatch):
    """Several sequences on a packed target are timed as its batched verifies run (`profile_packed`): its rows
    at contexts spread around the point's (their mean the point's), each repeat on the same contexts (the
    sessions put back after it), the token counts taken in turn, no profiling session left behind."""
    import specbench.decode.profile_packed as profile_packed
    from specbench.decode.kv import cached_length

    assert profile_packed.spread(12, 3) == [6, 12, 18] and profile_packed.spread(2, 2) == [2, 3]
    assert profile_packed.spread(100, 3, room=120) == [80, 100, 120]  # the longest kept within the model
    target = LocalTarget(tiny_model(seed=0))
    seen, rows = {}, []
    for piece in profile_packed.packed_batch_steps(target, [1, 3], [12], repeats=2, warmup=1, batches=[2, 3]):
        for name, state in target.sessions.items():
            seen.setdefault(name, set()).add(cached_length(state.cache))
        if piece is not None:
            assert piece["median_s"] > 0 and piece["batch"] in (2, 3)
            rows.append((piece["batch"], piece["tokens"]))
    assert rows == [(2, 1), (2, 3), (3, 1), (3, 3)] and not target.sessions
    lengths = {name.rsplit("-", 3)[-3]: [] for name in seen}
    for name, cached in seen.items():
        assert len(cached) == 1, (name, cached)  # put back after every repeat
        lengths[name.rsplit("-", 3)[-3]].append(cached.pop())
    assert sorted(lengths["2"]) == [5, 17] and sorted(lengths["3"]) == [5, 11, 17]  # each spread's tail not cached
    # a worker's --max-prompt-tokens bounds the longest row as it bounds the point's context
    bounded = set()
    for _ in profile_packed.packed_batch_steps(target, [1], [12], repeats=1, warmup=0, batches=[3], longest=14):
        bounded |= {cached_length(state.cache) for state in target.sessions.values()}
    assert bounded == {9, 11, 13} and not target.sessions
    # two profiles under way at once (two tenants' jobs, a slice each in turn) keep to their own sessions
    first, second = (profile_packed.packed_batch_steps(target, tokens, [12], repeats=2, warmup=1, batches=[2])
                     for tokens in ([2], [1, 2, 3]))
    rows = [piece for pair in itertools.zip_longest(first, second) for piece in pair if piece is not None]
    assert len(rows) == 4 and all(row["median_s"] > 0 for row in rows) and not target.sessions
    calls = []
    real = profile_packed.packed_batch_steps
    monkeypatch.setattr(profile_packed, "packed_batch_steps",
                        lambda *a, **k: calls.append((k["batches"], k["longest"])) or real(*a, **k))
    profile = RemoteTarget(worker.endpoint).profile(tokens=[1, 2], contexts=[12], repeats=2, batches=[1, 2])
    assert sorted((r["tokens"], r["batch"]) for r in profile["rows"]) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    from specbench.worker.limits import WorkerLimits

    assert calls == [([2], WorkerLimits().max_prompt_tokens)]  # the worker's own bound on a prompt, passed down


def _client_process(endpoint, prompt, queue):
    from specbench.api import outputs, run
    from specbench.worker.client import RemoteTarget

    remote = RemoteTarget(endpoint)
    got = outputs(run(remote, [prompt], method="prompt-lookup", max_new_tokens=24, progress=False, warmup=False))
    queue.put((tuple(prompt), got[("prompt-lookup", 0)]))


def test_eight_concurrent_client_processes(worker):
    reference = local_outputs(["target-only"])
    context = forked()
    queue = context.Queue()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    processes = [context.Process(target=_client_process, args=(worker.endpoint, p, queue)) for p in prompts]
    for process in processes:
        process.start()
    results = [queue.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(30)
    expected = {tuple(p): reference[("target-only", i)] for i, p in enumerate(PROMPTS)}
    assert len(results) == 8
    for prompt, got in results:
        assert got == expected[prompt]


def test_kill_9_and_restart_loses_no_token():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = start_process_worker(endpoint)
    reference = local_outputs(["chain"], max_new_tokens=60, prompts=PROMPTS[:1])[("chain", 0)]
    remote = RemoteTarget(endpoint, timeout_s=1.0, retries=60, network=NetworkEmulation(rtt_ms=30))
    draft = tiny_model(1, noise_from=tiny_model(0), noise_scale=0.005)
    result, midway, begin = {}, threading.Event(), remote.verify_begin

    def counted(*args, **kwargs):  # the kill lands mid-generation, after the fifth verify, whatever the box's speed
        result["verifies"] = result.get("verifies", 0) + 1
        if result["verifies"] == 5:
            midway.set()
        return begin(*args, **kwargs)

    remote.verify_begin = counted

    def generate():
        result["records"] = run(remote, PROMPTS[:1], method="chain", draft=draft, max_new_tokens=60,
                                progress=False, warmup=False)

    thread = threading.Thread(target=generate)
    thread.start()
    assert midway.wait(60), "the generation made no five steps"
    process.send_signal(signal.SIGKILL)
    process.wait()
    time.sleep(0.5)
    restarted = start_process_worker(endpoint)
    try:
        thread.join(120)
        assert "records" in result, "generation did not finish after the restart"
        assert outputs(result["records"])[("chain", 0)] == reference
        assert remote.reconnects > 0 and len(result["records"]) > 5
    finally:
        restarted.kill()


def test_curve_auth_refuses_clients_without_the_key(tmp_path):
    from specbench.cli import main

    main(["keys", str(tmp_path / "keys")])
    main(["keys", str(tmp_path / "other")])
    running = ThreadWorker(curve_keys=str(tmp_path / "keys"))
    try:
        good = RemoteTarget(running.endpoint, curve_keys=str(tmp_path / "keys"), timeout_s=5)
        assert good.health()
        with pytest.raises(WorkerUnavailableError):
            RemoteTarget(running.endpoint, timeout_s=1, retries=0)  # plain text client
        with pytest.raises(WorkerUnavailableError):
            RemoteTarget(running.endpoint, curve_keys=str(tmp_path / "other"), timeout_s=1, retries=0)
    finally:
        running.stop()


def test_non_loopback_bind_needs_keys_or_insecure():
    assert is_local_endpoint("tcp://127.0.0.1:5555") and is_local_endpoint("ipc:///tmp/x")
    assert is_local_endpoint("tcp://[::1]:5555") and is_local_endpoint("tcp://LocalHost:5555")
    assert not any(map(is_local_endpoint, ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::]:5555",
                                           "tcp://10.0.0.2:5555", "tcp://example.org:5555"]))
    with pytest.raises(SpecbenchError, match="refusing to bind tcp://0.0.0.0:5999"):
        Worker(WorkerConfig(bind="tcp://0.0.0.0:5999"))
    Worker(WorkerConfig(bind="tcp://0.0.0.0:5999", insecure=True))  # allowed when asked for


@pytest.mark.parametrize("bind", ["garbage", "tcp://127.0.0.1", "tcp://127.0.0.1:abc", "tcp://:5555", "ipc://"])
def test_an_address_zeromq_cannot_bind_is_refused_naming_the_forms(bind):
    """Before, `--bind garbage` was told to add CURVE keys (it is not a loopback address), and with
    --insecure met ZeroMQ's own "Invalid argument", as a client connecting to it did."""
    for insecure in (False, True):
        with pytest.raises(SpecbenchError, match="--bind takes tcp://HOST:PORT"):
            Worker(WorkerConfig(bind=bind, insecure=insecure))
    with pytest.raises(SpecbenchError, match="a worker endpoint takes tcp://HOST:PORT"):  # a client's, too
        RemoteTarget(bind, timeout_s=1, retries=0)
    Worker(WorkerConfig(bind="tcp://[::1]:5999"))  # IPv6 loopback, and a port of *, stay accepted
    Worker(WorkerConfig(bind="tcp://127.0.0.1:*"))


def test_session_cap_and_idle_expiry():
    running = ThreadWorker(limits={"max_sessions": 2}, idle_timeout_s=0.5)
    try:
        clients = [RemoteTarget(running.endpoint) for _ in range(3)]
        clients[0].prefill("a", [1, 2])
        clients[1].prefill("b", [1, 2])
        with pytest.raises(WorkerError, match=r"open sessions: 3 exceeds the worker.s limit of 2 \(--max-sessions\)"):
            clients[2].prefill("c", [1, 2])
        time.sleep(1.0)
        assert running.worker.stats.expired == 2
        clients[2].prefill("c", [1, 2])  # room again after expiry
        # an expired session is rebuilt by the client from the tokens it holds
        verdict = clients[0].verify("a", DraftTree(), SamplingParams(), 0)
        assert clients[0].committed("a") == [1, 2, verdict.bonus_token]
    finally:
        running.stop()


def test_lazy_worker_loads_on_request():
    running = ThreadWorker(model=None, lazy=True, allow_load=("no-such-model-here",))
    try:
        with pytest.raises(SpecbenchError, match="no model loaded"):
            RemoteTarget(running.endpoint)
        remote = RemoteTarget(running.endpoint, model=ModelSpec(TARGET))
        assert remote.vocab_size == 96
        with pytest.raises(WorkerError, match="unknown catalog model|could not load"):
            RemoteTarget(running.endpoint, model=ModelSpec("no-such-model-here"))
        assert RemoteTarget(running.endpoint, model=ModelSpec(TARGET)).health()  # still serving
    finally:
        running.stop()


def test_a_client_gets_the_workers_tokenizer_once_and_an_older_worker_sends_none(monkeypatch):
    """A tiny model has no tokenizer: the client reads None after one "tokenizer" request, and asks no more in
    this process; a worker without the op (older) gives None too, not an error; file names that are not plain
    names are refused before anything is written."""
    from specbench.worker import tokenizer_files
    from specbench.worker.client import RemoteTarget

    monkeypatch.setattr(tokenizer_files, "_loaded", {})
    running = ThreadWorker()
    try:
        remote = RemoteTarget(running.endpoint)
        before = running.worker.stats.requests
        assert remote.tokenizer is None and remote.tokenizer is None
        assert running.worker.stats.requests == before + 1
        assert RemoteTarget(running.endpoint).tokenizer is None and running.worker.stats.requests == before + 2  # hello
        with pytest.raises(SpecbenchError, match="no tokenizer"):
            run(remote, ["text"], method="target-only", progress=False)
        monkeypatch.setattr(tokenizer_files, "_loaded", {})
        del running.worker.ops.handlers["tokenizer"]
        assert RemoteTarget(running.endpoint).tokenizer is None
    finally:
        running.stop()
    for files in ({"../evil.json": b"{}"}, {".hidden": b""}, {"a/b": b""}, {"tokenizer.json": "not bytes"}):
        with pytest.raises(SpecbenchError, match="plain named files"):
            tokenizer_files.tokenizer_from_files(files, "m|float32|cpu|0")
    with pytest.raises(SpecbenchError, match="did not load here"):
        tokenizer_files.tokenizer_from_files({"tokenizer.json": b"{not json"}, "m|float32|cpu|1")
