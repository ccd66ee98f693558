"""The worker never changes a legitimate client's output: stalls, foreign clients, loads, limits.

Each test puts a legitimate `RemoteTarget` user beside a hand-written pyzmq client (`RawClient`)
against a real `specbench worker` process, and asserts the user's output is identical to an
undisturbed run or that the user got an error: never different output.
"""
import re
import threading
import time

import numpy as np
import pytest

from specbench.api import outputs, run
from specbench.models.tiny import tiny_model
from specbench.types import DraftTree, SpecbenchError
from specbench.worker import protocol
from specbench.worker.client import RemoteTarget

from conftest import PROMPTS
from worker_helpers import TARGET, RawClient, free_port, process_worker, start_process_worker

TOKENS = 40


@pytest.fixture(scope="module")
def draft():
    return tiny_model(1, noise_from=tiny_model(0), noise_scale=0.005)


@pytest.fixture(scope="module")
def reference(draft):
    return outputs(run(tiny_model(0), PROMPTS[:1], method="chain", draft=draft, max_new_tokens=TOKENS,
                       progress=False, warmup=False))[("chain", 0)]


@pytest.fixture(scope="module")
def worker():
    """One real worker process for the module: starting one costs seconds; each test brings its own clients."""
    with process_worker() as process:
        yield process


def victim_run(remote, draft, tokens=TOKENS):
    return outputs(run(remote, PROMPTS[:1], method="chain", draft=draft, max_new_tokens=tokens, progress=False,
                       warmup=False))[("chain", 0)]


def in_thread(function):
    """Run `function` in a thread; returns a dict that holds its result or its exception once joined."""
    outcome = {}

    def body():
        try:
            outcome["result"] = function()
        except Exception as error:  # the test inspects it
            outcome["error"] = error

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


def opened_sessions(process):
    return re.findall(r"session (\S+) opened", "".join(process.log_lines))


class StallingDrafter:
    """Wraps a drafter; before the steps in `stall_at` it lets another client stall the worker first,
    so the user's next verify is queued behind that client's long request."""

    def __init__(self, inner, stall_at):
        self.inner, self.stall_at, self.calls = inner, set(stall_at), 0
        self.waiting, self.stalled = threading.Event(), threading.Event()

    def propose(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.stall_at:
            self.stalled.clear()
            self.waiting.set()
            assert self.stalled.wait(60), "the stalling client never came"
        return self.inner.propose(*args, **kwargs)


@pytest.mark.parametrize("resume_after_s", [0.35, 0.6, 0.85, 1.1])
def test_frozen_worker_resumed_at_any_phase_of_the_retries(worker, draft, reference, resume_after_s):
    """Defect 1: a stall outlasts the user's timeout; the user reconnects and resends while the worker
    still holds (and later runs) the abandoned copies. Another tenant's long request caused such stalls
    until slices were bounded (`test_worker_tenants.py`); here the worker is frozen (SIGSTOP) while a
    verify is queued and resumed at a chosen point of the client's timeout/reconnect/resend cycle, so
    the abandoned copies and the resent one all reach it in one burst."""
    import signal

    from specbench.decode.drafters import ModelDrafter
    from specbench.decode.loop import Decoding, generate

    remote = RemoteTarget(worker.endpoint, timeout_s=0.25, retries=20)
    drafter = StallingDrafter(ModelDrafter(draft, remote.vocab_size), stall_at=(2, 5))
    outcome = in_thread(lambda: generate(remote, drafter, PROMPTS[0], Decoding(4, TOKENS)))
    for _ in drafter.stall_at:
        assert drafter.waiting.wait(60)
        drafter.waiting.clear()
        worker.send_signal(signal.SIGSTOP)
        drafter.stalled.set()
        time.sleep(resume_after_s)
        worker.send_signal(signal.SIGCONT)
    outcome["thread"].join(120)
    assert remote.reconnects >= 2
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].output_ids == reference


def test_foreign_client_cannot_touch_a_session(worker, draft, reference):
    """Defect 2: a client that learns a session id (from the log) prefills and verifies it."""
    remote = RemoteTarget(worker.endpoint)
    release = threading.Event()

    class Pausing:  # the victim's drafter pauses after its first proposal until the attacker is done
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def propose(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 2:
                release.wait(30)
            return self.inner.propose(*args, **kwargs)

    from specbench.decode.drafters import ModelDrafter
    from specbench.decode.loop import Decoding, generate

    drafter = Pausing(ModelDrafter(draft, remote.vocab_size))
    outcome = in_thread(lambda: generate(remote, drafter, PROMPTS[0], Decoding(4, TOKENS)))
    deadline = time.time() + 30
    while not opened_sessions(worker) and time.time() < deadline:
        time.sleep(0.05)
    session = opened_sessions(worker)[-1]
    attacker = RawClient(worker.endpoint)
    verify = {"op": "verify", "session": session, "seed": 3, "epoch": 1, "committed": len(PROMPTS[0]),
              "sampling": {"temperature": 0.0}}
    chain = protocol.tree_to_arrays(DraftTree.chain([1, 2]))
    first, _ = attacker.request(verify, chain)
    assert not first["ok"] and first["code"] == "unknown-session", first
    closed, _ = attacker.request({"op": "close", "session": session})  # closes nothing, and says so
    assert closed["ok"] and closed["closed"] is False, closed
    # A prefill under that name opens the attacker's own session: it lives in the attacker's namespace.
    attacker.request({"op": "prefill", "session": session, "epoch": 99}, {"tokens": np.array([5, 6, 7], dtype=np.int32)})
    attacker.request(dict(verify, epoch=99, committed=3), chain)
    release.set()
    outcome["thread"].join(60)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].output_ids == reference


def test_load_by_another_client_is_refused_and_changes_nothing(worker, draft, reference):
    """Defect 3: any client could load another dtype/model and the user silently continued on it."""
    remote = RemoteTarget(worker.endpoint)
    attacker = RawClient(worker.endpoint)

    def victim():
        return victim_run(remote, draft)

    outcome = in_thread(victim)
    time.sleep(0.3)
    replies = [attacker.request({"op": "load", "model": {"model": TARGET, "dtype": "bfloat16"}})[0],
               attacker.request({"op": "load", "model": {"model": "tiny-random:seed=7"}})[0]]
    outcome["thread"].join(120)
    assert not any(reply["ok"] for reply in replies), replies
    assert all(reply["code"] == "refused" for reply in replies), replies
    assert outcome.get("result") == reference, outcome.get("error")


def test_failed_verify_leaves_the_session_as_it_was(worker):
    """Defect 5: a verify that fails after the forward left its tokens in the cache ("KV invariant broken")."""
    client = RawClient(worker.endpoint)
    tokens = np.array(PROMPTS[0], dtype=np.int32)
    header, _ = client.request({"op": "prefill", "session": "s", "epoch": 1}, {"tokens": tokens})
    assert header["ok"], header
    bad = [({"sampling": {"temperature": 1.0, "rule": "rejection"}}, DraftTree.chain([1, 2])),  # no q
           ({"sampling": {"temperature": 1.0, "top_k": 2.5}}, DraftTree.chain([1, 2])),
           ({"sampling": {"temperature": 0.0}}, DraftTree.chain([1, 10_000]))]
    for fields, tree in bad:
        reply, _ = client.request({"op": "verify", "session": "s", "seed": 1, "epoch": 1, "committed": len(tokens),
                                   **fields}, protocol.tree_to_arrays(tree))
        assert not reply["ok"] and reply["code"] == "bad-request", reply
    reply, arrays = client.request({"op": "verify", "session": "s", "seed": 1, "epoch": 1, "committed": len(tokens),
                                    "sampling": {"temperature": 0.0}}, protocol.tree_to_arrays(DraftTree()))
    assert reply["ok"], reply
    fresh = RawClient(worker.endpoint)
    fresh.request({"op": "prefill", "session": "s", "epoch": 1}, {"tokens": tokens})
    expected, _ = fresh.request({"op": "verify", "session": "s", "seed": 1, "epoch": 1, "committed": len(tokens),
                                 "sampling": {"temperature": 0.0}}, protocol.tree_to_arrays(DraftTree()))
    assert reply["bonus"] == expected["bonus"]


@pytest.mark.parametrize("header,arrays,limit", [
    ({"op": "generate", "method": "server-only-ar", "max_new_tokens": 10**7, "sampling": {}},
     {"tokens": np.array([1, 2], dtype=np.int32)}, "max_new_tokens"),
    ({"op": "profile", "tokens": list(range(1, 200)), "contexts": [16]}, None, "profile"),
    ({"op": "profile", "tokens": [1], "contexts": [16], "repeats": 100_000}, None, "repeats"),
    ({"op": "prefill", "session": "long", "epoch": 1}, {"tokens": np.ones(5000, dtype=np.int32)}, "prompt"),
], ids=["generate-tokens", "profile-grid", "profile-repeats", "prompt-tokens"])
def test_unbounded_requests_are_refused_before_work_starts(worker, header, arrays, limit):
    """Defect 4: no cap on generate, profile or prompt length let one request stall everyone."""
    client = RawClient(worker.endpoint)
    started = time.perf_counter()
    reply, _ = client.request(header, arrays, timeout_s=20)
    assert time.perf_counter() - started < 2.0
    assert not reply["ok"] and reply["code"] == "limit", reply
    assert limit in reply["error"]


def test_wide_tree_is_refused(worker):
    client = RawClient(worker.endpoint)
    client.request({"op": "prefill", "session": "s", "epoch": 1}, {"tokens": np.array([1, 2, 3], dtype=np.int32)})
    tree = DraftTree(tuple([1] * 3000), tuple([-1] * 3000))
    reply, _ = client.request({"op": "verify", "session": "s", "seed": 1, "epoch": 1, "committed": 3,
                               "sampling": {"temperature": 0.0}}, protocol.tree_to_arrays(tree))
    assert not reply["ok"] and reply["code"] == "limit" and "tree nodes" in reply["error"], reply


def fuzz_message(rng, token: str, session: str, foreign: str):
    """One malformed (or hostile) request: every kind the outside tester found, plus random mutations."""
    good_tree = protocol.tree_to_arrays(DraftTree.chain([1, 2, 3]))
    verify = {"op": "verify", "client": token, "session": session, "seed": 1, "epoch": 1, "committed": 3,
              "sampling": {"temperature": 0.0}}
    q_tree = {"tokens": np.array([1, 2], dtype=np.int32), "parents": np.array([-1, 0], dtype=np.int16),
              "node_q": np.array([0, 1], dtype=np.uint16), "q_len": np.array([1, 1], dtype=np.uint16),
              "q_ids": np.array([1, 2], dtype=np.int32), "q_probs": np.array([1.0, 1.0], dtype=np.float32)}
    rejection = dict(verify, sampling={"temperature": 1.0, "rule": "rejection"})
    kind = rng.randrange(27)
    if kind == 0:
        return [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 40)))]
    if kind == 1:
        frames = protocol.encode(verify, good_tree)
        return frames[: rng.randrange(1, len(frames))]
    if kind == 2:
        return protocol.encode({"op": rng.choice(["verify", "prefill", "close", 7]), "client": token,
                                "session": rng.choice([3, None, "", "x" * 300, "a b"])})
    if kind == 3:
        return protocol.encode({"op": "".join(rng.choice("abcxyz") for _ in range(6))})
    if kind == 4:
        return protocol.encode(dict(verify, session="nobody"), good_tree)
    if kind == 5:
        return protocol.encode(verify, protocol.tree_to_arrays(DraftTree.chain([1, 99_999])))
    if kind == 6:
        return protocol.encode(verify, {"tokens": np.array([1, 2, 3], dtype=np.int32),
                                        "parents": np.array([2, -1, 0], dtype=np.int16)})
    if kind == 7:
        return [protocol.msgpack.packb({"op": "prefill", "client": token, "session": session, "epoch": 9,
                                        "arrays": [["tokens", "int32", [5]]]}), b"abc"]
    if kind == 8:
        return protocol.encode({"op": "prefill", "client": token, "session": session, "epoch": 9},
                               {"tokens": np.zeros(600_000, dtype=np.int32)})
    if kind == 9:
        return protocol.encode(dict(verify, seed="x", sampling={"temperature": -2}), good_tree)
    if kind == 10:  # rank 0 and rank 2 ids
        shape = rng.choice([(), (2, 2)])
        return protocol.encode(verify, {"tokens": np.ones(shape, dtype=np.int32),
                                        "parents": np.zeros(shape, dtype=np.int16)})
    if kind == 11:
        return protocol.encode(verify, {"tokens": np.array([1, 2], dtype=np.int32),
                                        "parents": np.array([-1.0, 0.0], dtype=np.float32)})
    if kind == 12:  # a shape whose byte count overflows 64 bits
        return [protocol.msgpack.packb(dict(verify, arrays=[["tokens", "int64", [2**62, 2**62]],
                                                            ["parents", "int16", [1]]])), b"x" * 8, b"xx"]
    if kind == 13:
        bad = dict(q_tree, q_ids=np.array([1, 10**6], dtype=np.int32))
        return protocol.encode(rejection, bad)
    if kind == 14:
        return protocol.encode({"op": "profile", "client": token,
                                rng.choice(["tokens", "contexts", "repeats"]): rng.choice([[1.5], ["a"], 2.5, [[1]],
                                                                                           "x", [-1], -3])})
    if kind == 15:
        return protocol.encode({"op": "load", "client": token, "model": {"model": TARGET, "device": "cuda:0"}})
    if kind == 16:  # duplicate array names
        return [protocol.msgpack.packb(dict(verify, arrays=[["tokens", "int32", [1]], ["tokens", "int32", [1]],
                                                            ["parents", "int16", [1]]])),
                np.array([1], np.int32).tobytes(), np.array([1], np.int32).tobytes(),
                np.array([-1], np.int16).tobytes()]
    if kind == 17:
        return protocol.encode(rejection, dict(q_tree, node_q=np.array([0, -1], dtype=np.int32)))
    if kind == 18:
        value = rng.choice([float("nan"), float("inf"), -0.5, 3.0])
        return protocol.encode(rejection, dict(q_tree, q_probs=np.array([value, 1.0], dtype=np.float32)))
    if kind == 19:
        value = rng.choice([float("nan"), float("inf"), float("-inf")])
        return protocol.encode(dict(verify, sampling={"temperature": value}), good_tree)
    if kind == 20:
        return protocol.encode(dict(verify, client=rng.choice(["short", 5, "x" * 500, "bad token!" * 3])), good_tree)
    if kind == 21:  # the legitimate client's session, by name, from this client
        return protocol.encode(dict(verify, session=foreign), good_tree)
    if kind == 22:
        return protocol.encode(dict(verify, epoch=rng.choice([0, 2, -1, 2**70 // 2**10]),
                                    committed=rng.choice([0, 2, 4, 10**9])), good_tree)
    if kind == 23:
        return protocol.encode({"op": "generate", "client": token, "method": "server-only-ar",
                                "max_new_tokens": rng.choice([10**6, -1, 0, 1.5]), "sampling": {}},
                               {"tokens": np.array([1, 2], dtype=np.int32)})
    if kind == 24:
        return protocol.encode({"op": "load", "client": token,
                                "model": {"model": rng.choice(["/etc", "/no/such", "../..", "gpt2"]),
                                          **({"gguf_file": "../../etc/passwd"} if rng.random() < .5 else {})}})
    if kind == 25:
        return protocol.encode(dict(verify, sampling={"temperature": 1.0, "top_k": rng.choice([2.5, "3", -1, True]),
                                                      "bogus": 1}), good_tree)
    header = dict(verify)  # random mutation of a valid request
    header[rng.choice(list(header))] = rng.choice([None, -1, 2**63, 1.5, "x", [], {}, True, b"\x00"])
    return protocol.encode(header, good_tree)


def test_fuzz_never_crashes_never_internal_and_never_changes_output(draft, reference):
    """>= 3,000 malformed requests against a real worker process, with a legitimate client decoding beside."""
    with process_worker() as process:
        endpoint = process.endpoint
        from specbench.decode.drafters import ModelDrafter
        from specbench.types import SamplingParams
        import random
        import torch

        remote = RemoteTarget(endpoint)
        drafter = ModelDrafter(draft, remote.vocab_size)
        remote.prefill("good", PROMPTS[0])
        foreign = opened_sessions(process)[-1] if opened_sessions(process) else "good"
        fuzzer = RawClient(endpoint)
        assert fuzzer.request({"op": "prefill", "session": "victim", "epoch": 1},
                              {"tokens": np.array([1, 2, 3], dtype=np.int32)})[0]["ok"]
        rng, generator = random.Random(0), torch.Generator().manual_seed(0)
        produced, codes = [], {}
        for count in range(3000):
            fuzzer.send({}, raw=fuzz_message(rng, fuzzer.token, "victim", foreign))
            header, _ = fuzzer.receive(timeout_s=10)
            code = "ok" if header["ok"] else header["code"]
            codes[code] = codes.get(code, 0) + 1
            assert code != "internal", header
            assert header["ok"] or header["error"]
            if count % 100 == 0 and len(produced) < TOKENS:
                tree = drafter.propose(PROMPTS[0] + produced, min(4, TOKENS - 1 - len(produced)) or 1,
                                       SamplingParams(), generator)
                produced += remote.verify("good", tree, SamplingParams(), 0).emitted(tree)
        while len(produced) < TOKENS:
            tree = drafter.propose(PROMPTS[0] + produced, 4, SamplingParams(), generator)
            produced += remote.verify("good", tree, SamplingParams(), 0).emitted(tree)
        assert produced[:TOKENS] == reference
        assert codes.get("ok", 0) < 300 and sum(codes.values()) == 3000, codes
        assert process.poll() is None, "the worker died"
        assert remote.stats()["errors"] >= 2700


def _verify(client, **changes):
    return dict({"op": "verify", "session": "s", "seed": 1, "epoch": 1, "committed": 3,
                 "sampling": {"temperature": 0.0}}, **changes)


Q_TREE = {"tokens": np.array([1, 2], dtype=np.int32), "parents": np.array([-1, 0], dtype=np.int16),
          "node_q": np.array([0, 1], dtype=np.uint16), "q_len": np.array([1, 1], dtype=np.uint16),
          "q_ids": np.array([1, 2], dtype=np.int32), "q_probs": np.array([1.0, 1.0], dtype=np.float32)}
REJECTION = {"sampling": {"temperature": 1.0, "rule": "rejection"}}


@pytest.mark.parametrize("changes,arrays,message", [
    ({}, {"tokens": np.array(1, dtype=np.int32), "parents": np.array(-1, dtype=np.int16)}, "rank 1"),
    ({}, {"tokens": np.ones((2, 2), np.int32), "parents": np.zeros((2, 2), np.int16)}, "rank 1"),
    ({}, {"tokens": np.array([1, 2], np.int32), "parents": np.array([-1.0, 0.0], np.float32)}, "integers"),
    (REJECTION, dict(Q_TREE, q_ids=np.array([1, 10**6], np.int32)), "out of vocabulary"),
    (REJECTION, dict(Q_TREE, node_q=np.array([0, -1], np.int32)), "node_q"),
    (REJECTION, dict(Q_TREE, q_probs=np.array([float("nan"), 1.0], np.float32)), "NaN or infinite"),
    (REJECTION, dict(Q_TREE, q_probs=np.array([float("inf"), 1.0], np.float32)), "NaN or infinite"),
    (REJECTION, dict(Q_TREE, q_probs=np.array([-0.5, 1.0], np.float32)), r"\[0, 1\]"),
    ({"sampling": {"temperature": float("nan")}}, None, "finite"),
    ({"sampling": {"temperature": float("inf")}}, None, "finite"),
    ({"sampling": {"temperature": 1.0, "top_k": 2.5}}, None, "top_k must be an integer"),
    (REJECTION, {"tokens": np.array([1, 2], np.int32), "parents": np.array([-1, 0], np.int16)}, "needs the draft"),
], ids=["0d-ids", "2d-ids", "float-parents", "q-oov", "negative-node_q", "nan-q", "inf-q", "negative-q",
        "nan-temperature", "inf-temperature", "float-top_k", "rejection-without-q"])
def test_malformed_verify_is_a_bad_request(worker, changes, arrays, message):
    client = RawClient(worker.endpoint)
    client.request({"op": "prefill", "session": "s", "epoch": 1}, {"tokens": np.array([1, 2, 3], np.int32)})
    arrays = arrays if arrays is not None else protocol.tree_to_arrays(DraftTree.chain([1, 2]))
    reply, _ = client.request(_verify(client, **changes), arrays)
    assert not reply["ok"] and reply["code"] == "bad-request", reply
    assert re.search(message, reply["error"]), reply["error"]
    ok, _ = client.request(_verify(client), protocol.tree_to_arrays(DraftTree.chain([1, 2])))
    assert ok["ok"], ok  # the refusal left the session usable


@pytest.mark.parametrize("frames,message", [
    (lambda: [protocol.msgpack.packb({"op": "verify", "arrays": [["t", "int64", [2**62, 2**62]]]}), b"x" * 8],
     "each dimension"),
    (lambda: [protocol.msgpack.packb({"op": "verify", "arrays": [["t", "int32", [1]], ["t", "int32", [1]]]}),
              b"\0" * 4, b"\0" * 4], "appears twice"),
    (lambda: protocol.encode({"op": "profile", "tokens": [1.5], "contexts": [16]}), "list of integers"),
    (lambda: protocol.encode({"op": "profile", "tokens": [1], "contexts": ["16"]}), "list of integers"),
    (lambda: protocol.encode({"op": "profile", "repeats": 2.0}), "must be int"),
    (lambda: protocol.encode({"op": "load", "model": {"model": TARGET, "device": "cuda:0"}}), "device 'cuda:0'"),
    (lambda: protocol.encode({"op": "verify", "session": "s", "client": "short"}), "field 'client'"),
], ids=["overflowing-shape", "duplicate-array", "float-profile-tokens", "string-profile-context",
        "float-repeats", "cuda-on-cpu-worker", "bad-client-token"])
def test_malformed_requests_name_the_problem(worker, frames, message):
    client = RawClient(worker.endpoint)
    raw = frames()
    if raw[0][:1] != b"\x00":  # give well-formed headers the client's token unless the case is about it
        header = protocol.msgpack.unpackb(raw[0])
        header.setdefault("client", client.token)
        raw = [protocol.msgpack.packb(header)] + raw[1:]
    reply, _ = client.request({}, raw=raw)
    assert not reply["ok"] and reply["code"] in ("bad-request", "refused"), reply
    assert message in reply["error"], reply["error"]


def test_load_policy(worker):
    """Defect 3: loads need an allow-list; a refusal says nothing about which paths exist; no traversal."""
    client = RawClient(worker.endpoint)
    replies = {name: client.request({"op": "load", "model": {"model": name}})[0]
               for name in ("/etc", "/no/such/dir", "gpt2")}
    assert all(reply["code"] == "refused" for reply in replies.values()), replies
    texts = {reply["error"].replace(name, "NAME") for name, reply in replies.items()}
    assert len(texts) == 1, texts  # identical but for the name: existence of paths does not leak
    traversal, _ = client.request({"op": "load", "model": {"model": TARGET, "gguf_file": "../../etc/passwd"}})
    assert traversal["code"] == "refused" and "plain file name" in traversal["error"]
    same, _ = client.request({"op": "load", "model": {"model": TARGET}})
    assert same["ok"]  # the served model itself is always fine (a no-op)


def test_model_switch_only_by_the_sole_client_and_never_silent():
    """An allow-listed switch is refused while other clients have sessions; a failed load leaves the
    model serving; a switch by the only client ends its sessions with a reason it receives."""
    from specbench.types import SamplingParams
    from specbench.worker.client import ModelChangedError

    other_model = "tiny-random:seed=0,layers=2"
    with process_worker("--allow-load", other_model, "--allow-load", "/no/such/model") as process:
        endpoint = process.endpoint
        alice, bob = RemoteTarget(endpoint), RemoteTarget(endpoint)
        alice.prefill("a", PROMPTS[0])
        bob.prefill("b", PROMPTS[1])
        carol = RawClient(endpoint)
        refused, _ = carol.request({"op": "load", "model": {"model": other_model}})
        assert refused["code"] == "refused" and "in use by 2 sessions of other clients" in refused["error"]
        bob.close("b")
        as_alice = RawClient(endpoint, token=alice.token)
        failed, _ = as_alice.request({"op": "load", "model": {"model": "/no/such/model"}})
        assert failed["code"] == "bad-request" and "could not load" in failed["error"], failed
        before = alice.verify("a", DraftTree(), SamplingParams(), 0)  # the old model still serves
        assert before.bonus_token >= 0
        switched, _ = as_alice.request({"op": "load", "model": {"model": other_model}})
        assert switched["ok"] and switched["identity"] != alice.model_identity
        with pytest.raises(ModelChangedError, match="model changed"):
            alice.verify("a", DraftTree(), SamplingParams(), 0)


def test_worker_restarted_with_another_model_is_never_decoded_on(draft):
    """Defect 3's other half: after a restart the client re-prefills; a different model then raises."""
    import signal

    from specbench.types import SamplingParams
    from specbench.worker import client

    ModelChangedError = getattr(client, "ModelChangedError", ())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = start_process_worker(endpoint)
    remote = RemoteTarget(endpoint, timeout_s=1.0, retries=30)
    remote.prefill("a", PROMPTS[0])
    remote.verify("a", DraftTree(), SamplingParams(), 0)
    process.send_signal(signal.SIGKILL)
    process.wait()
    from worker_helpers import ForkedWorker

    restarted = ForkedWorker(endpoint, "--model", "tiny-random:seed=0,layers=2", timeout_s=60)
    try:
        with pytest.raises(SpecbenchError, match="now serves tiny-random:seed=0,layers=2") as raised:
            remote.verify("a", DraftTree(), SamplingParams(), 0)
        assert isinstance(raised.value, ModelChangedError)
    finally:
        restarted.kill()
        restarted.wait()


def test_failed_verify_rolls_back_on_a_local_target(tiny_target, monkeypatch):
    """Defect 5 at its source: the forward had extended the cache when verification raised."""
    from specbench.decode import target as target_module
    from specbench.types import SamplingParams, SparseDist

    target = target_module.LocalTarget(tiny_target)
    target.prefill("s", PROMPTS[0])
    tree = DraftTree.chain([1, 2])
    bad_q = DraftTree.chain([1, 2], [SparseDist((1,), (1.0,)), SparseDist((3,), (1.0,))])  # node 1 not in its q
    for bad, sampling in ((tree, SamplingParams(temperature=1.0, rule="rejection")),
                          (bad_q, SamplingParams(temperature=1.0, rule="rejection"))):
        with pytest.raises(SpecbenchError):
            target.verify("s", bad, sampling, 0)
    with monkeypatch.context() as patch:  # a failure after the forward, whatever its cause
        patch.setattr(target_module, "verify", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            target.verify("s", tree, SamplingParams(), 0)
    got = target.verify("s", tree, SamplingParams(), 0)
    fresh = target_module.LocalTarget(tiny_target)
    fresh.prefill("s", PROMPTS[0])
    expected = fresh.verify("s", tree, SamplingParams(), 0)
    assert (got.accepted_path, got.bonus_token) == (expected.accepted_path, expected.bonus_token)
    assert target.committed("s") == fresh.committed("s")


def test_session_quota_per_client_and_kv_limit_counting_the_request():
    """Defect 6: one client's prefills filled every slot; a prefill alone over the KV limit was admitted."""
    with process_worker("--max-sessions-per-client", "2", "--max-kv-gib", str(200 * 768 / 2**30)) as process:
        endpoint = process.endpoint
        greedy = RawClient(endpoint)
        tokens = np.arange(1, 9, dtype=np.int32)
        for name in ("a", "b"):
            assert greedy.request({"op": "prefill", "session": name, "epoch": 1}, {"tokens": tokens})[0]["ok"]
        third, _ = greedy.request({"op": "prefill", "session": "c", "epoch": 1}, {"tokens": tokens})
        assert third["code"] == "limit" and "--max-sessions-per-client" in third["error"], third
        other = RawClient(endpoint)
        assert other.request({"op": "prefill", "session": "a", "epoch": 1}, {"tokens": tokens})[0]["ok"]
        # 768 bytes of KV per token for the tiny model (2 x 3 layers x 2 heads x 16 x 4 B): 200 tokens fit in all;
        # 24 are held, so a prefill of 190 more is refused before it runs
        huge, _ = other.request({"op": "prefill", "session": "big", "epoch": 1},
                                {"tokens": np.ones(190, dtype=np.int32)})
        assert huge["code"] == "limit" and "KV cache" in huge["error"], huge


def test_secret_keys_are_private(tmp_path):
    import os
    import stat

    from specbench.cli import main

    main(["keys", str(tmp_path / "keys")])
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(tmp_path / "keys" / name).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700


@pytest.mark.serial
def test_no_retries_waits_one_timeout(worker):
    """Defect 8: with retries=0 a verify to a frozen worker waited twice the timeout it reported."""
    import signal

    from specbench.types import SamplingParams
    from specbench.worker.client import WorkerUnavailableError

    remote = RemoteTarget(worker.endpoint, timeout_s=0.5, retries=0)
    remote.prefill("a", PROMPTS[0])
    worker.send_signal(signal.SIGSTOP)
    try:
        started = time.perf_counter()
        with pytest.raises(WorkerUnavailableError, match="within 0.5s on any of 1 tries"):
            remote.verify("a", DraftTree(), SamplingParams(), 0)
        assert time.perf_counter() - started < 0.9
    finally:
        worker.send_signal(signal.SIGCONT)


def test_busy_worker_buffers_a_bounded_inbound_queue():
    """Defect 6: a busy worker read every inbound message into memory (up to 1,000 x 16 MiB per peer).
    Now it buffers --inbound-queue messages per connection and leaves the rest to TCP backpressure.
    The worker is kept busy by a profile of wide forwards, each one slice (the operator allowed slices
    of 32,768 tokens), timed once alone first, so what it allocates is not counted as flood."""
    import psutil
    import zmq

    with process_worker("--slice-tokens", "32768") as process:
        endpoint = process.endpoint
        memory = psutil.Process(process.pid)
        flooder, busy = RawClient(endpoint), RawClient(endpoint)
        flooder.request({"op": "health"})
        busy_request = {"op": "profile", "tokens": [64], "contexts": [448], "batches": [64], "repeats": 20}

        def growth(flood: bool) -> float:
            before = memory.memory_info().rss
            busy.send(busy_request)
            time.sleep(0.2)  # the worker is now computing; its I/O thread still reads the network
            if flood:
                frames = protocol.encode({"op": "prefill", "client": flooder.token, "session": "s", "epoch": 1},
                                         {"tokens": np.ones(200_000, np.int32)})  # 0.8 MB each, under the limit
                for _ in range(400):
                    try:
                        flooder.socket.send_multipart([b"", *frames], flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
            peak, deadline = 0, time.time() + 1.0
            while time.time() < deadline:
                peak = max(peak, memory.memory_info().rss)
                time.sleep(0.005)
            assert busy.receive(timeout_s=60)[0]["ok"]
            return (peak - before) / 2**20

        alone = growth(flood=False)
        flooded = growth(flood=True)
        assert flooded - alone < 64, f"worker grew {flooded:.0f} MiB under a 320 MB flood ({alone:.0f} MiB without)"
