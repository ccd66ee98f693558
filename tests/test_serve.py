"""`specbench serve` through the official `openai` client on loopback: greedy text identical to `run`'s
target-only output for target-only, a chain and prompt lookup, with a worker in the server's process
and with a separate worker; seeded sampling reproducible; every refusal with its code and no server
error logged; a dropped stream frees its session; the metrics a vLLM board reads; the chat page in
headless Chromium (screenshots in reports/screenshots/).
"""
import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from specbench.api import outputs, run  # noqa: E402
from specbench.serve import Limits, ServeSettings  # noqa: E402
from specbench.serve.background import BackgroundServer  # noqa: E402
from specbench.types import SpecbenchError  # noqa: E402
from specbench.worker.launch import free_port, spawn_worker  # noqa: E402

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m"
PROMPTS = ["Write a Python function that returns the sum of a list of numbers.",
           "Repeat after me: the cat sat on the mat, the cat sat on the mat."]
METHODS = [("target-only", None), ("chain", 3), ("prompt-lookup", 3)]
TOKENS = 24
SHOTS = Path(__file__).resolve().parents[1] / "reports" / "screenshots"


class Served(BackgroundServer):
    def client(self, key: str = "none"):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)


def settings(**changes) -> ServeSettings:
    base = dict(target=MODEL, methods=("target-only", "chain", "prompt-lookup", "suffix"), draft=MODEL, k=3,
                port=free_port(), limits=Limits(max_tokens=128, max_prompt_tokens=256, max_body_bytes=20_000))
    return ServeSettings(**{**base, **changes})


@pytest.fixture(scope="module")
def expected(smollm2):
    """Target-only greedy ids per prompt from `run`, chat-templated and raw, as text."""
    chat = outputs(run(smollm2, PROMPTS, method="target-only", max_new_tokens=TOKENS, progress=False))
    raw = outputs(run(smollm2, PROMPTS, method="target-only", max_new_tokens=TOKENS, chat=False, progress=False))
    text = lambda ids: smollm2.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return {"chat": [text(chat[("target-only", i)]) for i in range(len(PROMPTS))],
            "raw": [text(raw[("target-only", i)]) for i in range(len(PROMPTS))],
            "chat_tokens": [len(chat[("target-only", i)]) for i in range(len(PROMPTS))]}


@pytest.fixture(scope="module")
def errors_logged():
    """ERROR records of the server's loggers (uvicorn's and ours) while this module runs."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.ERROR)
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "fastapi", "starlette")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


ROUTED = ("target-only", ("prompt-lookup", 3), ("suffix", 16))  # auto's candidates


def router_file(folder: Path, candidates=ROUTED) -> str:
    """A router over `candidates` fitted on synthetic steps (a lookup pays on prompts that repeat themselves):
    what method auto reads, with no calibration run."""
    import pandas as pd

    from specbench.route.router import Candidate, fit_router

    prompts = [[5, 6, 7, 8] * 6, [3, 4] * 10, [11, 40, 73, 2, 95, 17], [60, 21, 88, 4, 33, 70, 9]]
    chosen = [Candidate(*c) if isinstance(c, tuple) else Candidate(c) for c in candidates]
    rows = [dict(method=c.recorded, k=c.k, prompt_index=i, emitted=3 if c.drafts and i < 2 else 1,
                 drafted=c.k if c.drafts else 0, step_s=0.012 if c.drafts else 0.010)
            for c in chosen for i in range(len(prompts)) for _ in range(4)]
    return str(fit_router(pd.DataFrame(rows), prompts, chosen).save(folder / "router.json"))


@pytest.fixture(scope="module")
def local(errors_logged, tmp_path_factory):
    served = Served(settings(methods=("target-only", "chain", "prompt-lookup", "suffix", "auto", "chain-confident"),
                             router=router_file(tmp_path_factory.mktemp("router")), stop_below=0.6))
    yield served
    served.close()


@pytest.fixture(scope="module")
def remote(errors_logged):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = spawn_worker(endpoint, "--model", MODEL)
    served = Served(settings(worker=endpoint, api_key="sk-test",
                             limits=Limits(max_tokens=128, max_concurrent=1, max_queue=0)))
    served.worker_endpoint = endpoint
    yield served
    served.close()
    worker.terminate()
    worker.wait(timeout=30)


def speculative(method, k):
    return {"speculative": {"method": method, **({"k": k} if k else {})}}


def chat_text(client, prompt, method, k, stream):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=TOKENS, temperature=0, stream=stream,
                                           extra_body=speculative(method, k))
    if not stream:
        return reply.choices[0].message.content, reply.usage
    text, usage = "", None
    for chunk in reply:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text, usage


@pytest.mark.parametrize("where", ["local", "remote"])
def test_greedy_text_is_target_only_text_for_every_method(where, request, expected):
    served = request.getfixturevalue(where)
    client = served.client("sk-test" if where == "remote" else "none")
    for number, (method, k) in enumerate(METHODS):
        for index, prompt in enumerate(PROMPTS):
            stream = (number + index) % 2 == 1  # each method and each prompt both ways, 6 requests not 12
            text, usage = chat_text(client, prompt, method, k, stream)
            assert text == expected["chat"][index], (where, method, index, stream)
            if usage is not None:
                assert usage.completion_tokens == expected["chat_tokens"][index]
                assert usage.speculative["method"] == method
                if method == "chain":  # the draft is the target itself: its drafts are accepted
                    assert usage.speculative["accepted_tokens"] > 0 and usage.speculative["tokens_per_step"] > 1.5
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                           extra_body=speculative("prompt-lookup", 3))
    assert completion.choices[0].text == expected["raw"][1]
    assert completion.usage.speculative["accepted_tokens"] > 0  # the prompt repeats itself


def test_a_confident_chain_drafts_at_the_servers_threshold_and_keeps_target_only_text(local, expected):
    """`--stop-below` reaches the drafters serve builds: its chains end where the draft (here the target itself)
    gave a token less than 0.6, so a step drafts fewer than K, and the text is target-only's."""
    client = local.client()
    for index, prompt in enumerate(PROMPTS):
        text, usage = chat_text(client, prompt, "chain-confident", 8, stream=index == 0)
        assert text == expected["chat"][index], index
    assert usage.speculative["method"] == "chain-confident"
    assert 1 < usage.speculative["tokens_per_step"] < 8, usage.speculative
    assert local.engine.settings.stop_below == 0.6


def test_concurrent_requests_get_what_they_get_alone(local, expected):
    """Their verifies share the worker's batched forwards; no request changes another's output."""
    client = local.client()
    jobs = [(index, method, k) for index in range(len(PROMPTS)) for method, k in METHODS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: chat_text(client, PROMPTS[job[0]], job[1], job[2], stream=True)[0], jobs))
    assert texts == [expected["chat"][index] for index, _, _ in jobs]


def test_a_request_sets_suffix_decodings_step_knobs(local, expected):
    """speculative.suffix changes the knobs of that request only: a floor no proposal reaches drafts
    nothing, the server's defaults draft the repeating prompt, and the text is target-only's either way."""
    client = local.client()

    def ask(suffix):
        extra = {"speculative": {"method": "suffix", "k": 8, **({"suffix": suffix} if suffix else {})}}
        reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                          extra_body=extra)
        return reply.choices[0].text, reply.usage.speculative

    floored, usage = ask({"min_score": 1000.0, "factor": 2})
    assert floored == expected["raw"][1] and usage["drafted_tokens"] == 0
    assert usage["suffix"] == {"factor": 2, "min_score": 1000.0}
    plain, usage = ask(None)
    assert plain == expected["raw"][1] and usage["accepted_tokens"] > 0 and "suffix" not in usage


def test_auto_routes_each_request_says_why_and_stays_lossless(local, expected):
    """Method auto: the server's router picks each request's method and K from its prompt; the usage names the
    choice and every candidate's predicted tokens/s; the text is target-only's; a K with auto is refused by name."""
    client = local.client()
    labels = {"target-only", "prompt-lookup k=3", "suffix k=16"}
    for index, prompt in enumerate(PROMPTS):
        text, usage = chat_text(client, prompt, "auto", None, stream=False)
        spec = usage.speculative
        assert text == expected["chat"][index]
        assert spec["method"] == "auto" and spec["chosen"] in labels and set(spec["route_predicted"]) == labels
        assert spec["k"] == {"target-only": 0, "prompt-lookup k=3": 3, "suffix k=16": 16}[spec["chosen"]]
        assert spec["steps"] >= 1 and (spec["chosen"] != "target-only" or spec["drafted_tokens"] == 0)
        assert "route_note" not in spec  # this router does not know its calibration's length
    with pytest.raises(openai.BadRequestError, match="takes no k"):
        chat_text(client, PROMPTS[0], "auto", 4, stream=False)
    from dataclasses import replace

    routed, local.engine.router = local.engine.router, replace(local.engine.router, reply_tokens=TOKENS * 4)
    try:  # calibrated on replies 4x as long as these requests ask for: the usage says why the choice may not hold
        _, usage = chat_text(client, PROMPTS[0], "auto", None, stream=False)
    finally:
        local.engine.router = routed
    assert f"up to {TOKENS * 4} tokens and now serves {TOKENS}-token ones" in usage.speculative["route_note"]
    offered = httpx.get(f"{local.url}/specbench/settings").json()
    assert "auto" in offered["methods"] and set(offered["router"]) == labels
    from specbench.hardware import device_name

    assert offered["target_device"] == device_name("cpu")  # what the predictions are read for, first
    priced = [p for p in offered["predicted"].values() if "missing" not in p]
    assert all(p["here"] == (p["device"] == device_name("cpu")) for p in priced)


def test_a_tuned_method_asked_for_replies_far_from_the_tunes_length_is_told_so(local, expected):
    """`serve --config`: a request running the tune's method over twice (or under half) the reply length the tune
    measured at carries a `tune_note` in its usage; one near that length, or running another method, none."""
    settings = local.engine.settings  # frozen; the app reads this object: set the tune's fields for this test only
    client, notes = local.client(), {}
    try:
        for method, measured in (("chain", TOKENS * 4), ("chain", TOKENS), ("target-only", TOKENS * 4)):
            object.__setattr__(settings, "tuned", ("chain", measured))
            text, usage = chat_text(client, PROMPTS[0], method, 3 if method == "chain" else None, stream=False)
            assert text == expected["chat"][0]
            notes[(method, measured)] = usage.speculative.get("tune_note")
    finally:
        object.__setattr__(settings, "tuned", None)
    assert f"up to {TOKENS * 4} tokens and now serves {TOKENS}-token ones" in notes[("chain", TOKENS * 4)]
    assert "specbench tune --max-new-tokens 24" in notes[("chain", TOKENS * 4)]
    assert notes[("chain", TOKENS)] is None and notes[("target-only", TOKENS * 4)] is None


def test_an_auto_request_routed_past_suffix_decoding_still_leaves_its_output_in_the_servers_cache(local):
    """As in calibration and in `run`'s auto: a later request quoting it drafts from it. A plain target-only
    request leaves nothing (only suffix drafters and auto keep outputs)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from specbench.methods import suffix_cache

    engine = local.engine
    memory = suffix_cache(engine._source(SimpleNamespace(vocab_size=engine.vocab_size)))  # the server's cache
    routed, engine.router = engine.router, replace(engine.router, default="target-only", margin=float("inf"))
    try:
        before = memory.tokens
        _, usage = chat_text(local.client(), "Name three colours of a rainbow.", "target-only", None, stream=False)
        assert memory.tokens == before
        _, usage = chat_text(local.client(), "Name three colours of a rainbow.", "auto", None, stream=False)
        assert usage.speculative["chosen"] == "target-only" and memory.tokens == before + usage.completion_tokens
    finally:
        engine.router = routed


def test_a_router_serve_cannot_route_with_is_refused_before_any_model_loads(tmp_path):
    from specbench.serve.engine import Engine

    with pytest.raises(SpecbenchError, match="start serve with --router"):
        settings(methods=("auto",))
    stranded = router_file(tmp_path, ("target-only", ("suffix-server", 8)))
    with pytest.raises(SpecbenchError, match=r"\['suffix-server k=8'\] run wholly on a worker"):
        Engine(settings(methods=("auto",), router=stranded))
    (tmp_path / "own").mkdir()
    own = router_file(tmp_path / "own", ("target-only", ("chain", 3, "smollm2-135m")))
    with pytest.raises(SpecbenchError, match=r"\['chain@smollm2-135m k=3'\] draft with a model of their own"):
        Engine(settings(methods=("auto",), router=own))


def test_a_planned_server_picks_k_per_step_and_stays_lossless(remote, expected):
    """--plan: the shipped SmolLM2 profile and prompt-lookup reference steer K step by step."""
    import threading

    from specbench.serve.engine import Engine, Job
    from specbench.serve.settings import Speculation

    engine = Engine(ServeSettings(target=MODEL, methods=("prompt-lookup",), k=6, plan=True,
                                  worker=remote.worker_endpoint), log=lambda line: None)
    try:
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}], tokenize=False,
                                                   add_generation_prompt=True)
        ids = engine.tokenizer(ids, add_special_tokens=False)["input_ids"]
        events = list(engine.stream(Job(ids, TOKENS, Speculation("prompt-lookup", 6)), threading.Event()))
    finally:
        engine.close()
    records = events[-1].records
    assert all(r.planned for r in records) and all(0 <= r.step_k <= 6 for r in records)
    text = "".join(p.text for event in events for p in event.pieces)
    assert text == expected["chat"][1]
    with pytest.raises(Exception, match="--plan"):
        Engine(ServeSettings(target=MODEL, methods=("target-only",), plan=True, worker=remote.worker_endpoint))


def test_a_planned_server_on_a_device_its_cache_has_no_profile_of_says_so_at_start(remote, monkeypatch):
    """--plan prefers a profile of the device the target runs on (before, this CPU's, even serving on a GPU); where
    the cache holds only another device's, the start says that K may not suit this one."""
    import specbench.serve.engine as engine_module

    said = []
    monkeypatch.setattr(engine_module, "target_device", lambda runner: "NVIDIA-H200")
    engine = engine_module.Engine(ServeSettings(target=MODEL, methods=("prompt-lookup",), k=6, plan=True,
                                                worker=remote.worker_endpoint), log=said.append)
    engine.close()
    assert engine.target_device == "NVIDIA-H200"
    assert [line for line in said if line.startswith("--plan, prompt-lookup: the step planner prices K from a profile")
            and "measured on cpu-" in line and "and the target runs on NVIDIA-H200: its K may not suit" in line], said


def test_serve_with_a_worker_needs_no_target_name_and_refuses_a_wrong_one(remote):
    """`specbench serve --worker ENDPOINT` serves the worker's model under its name, with the worker's tokenizer
    (the remote fixture's text equals target-only's: that tokenizer is the one in use); a --target naming another
    model is refused naming the right one."""
    from specbench.cli import build_parser
    from specbench.serve.command import settings_from
    from specbench.serve.engine import Engine

    args = build_parser().parse_args(["serve", "--worker", remote.worker_endpoint, "--method", "target-only"])
    assert settings_from(args).target == MODEL
    assert remote.engine.tokenizer.chat_template  # came from the worker, chat template and all
    with pytest.raises(SpecbenchError, match=f"serves '{MODEL}', not 'qwen2.5-coder-0.5b'.*--target {MODEL}, or "
                                             f"with no --target"):
        Engine(ServeSettings(target="qwen2.5-coder-0.5b", methods=("target-only",), worker=remote.worker_endpoint))


def test_a_method_that_cannot_run_is_refused_at_start(remote):
    """A chain without a draft model fails at start, naming the method; a self-draft (the target's own
    weights) is not asked for one, and beside another process's worker it is refused for that reason."""
    from specbench.serve.engine import Engine

    ServeSettings(target=MODEL, methods=("self-draft", "substitute"))
    with pytest.raises(SpecbenchError, match="'chain' cannot be served.*needs a draft model"):
        Engine(ServeSettings(target=MODEL, methods=("target-only", "chain"), worker=remote.worker_endpoint))
    with pytest.raises(SpecbenchError, match="'self-draft' cannot be served.*target in this process"):
        Engine(ServeSettings(target=MODEL, methods=("self-draft",), worker=remote.worker_endpoint))


def test_stream_carries_pieces_usage_and_timing(local):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **speculative("chain", 3)}
    chunks = []
    with httpx.stream("POST", f"{local.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    pieces = [p for c in chunks for p in c.get("specbench", {}).get("pieces", [])]
    assert {source for _, source in pieces} == {"draft", "target"}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "".join(piece for piece, _ in pieces) == text
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish[0]["choices"][0]["finish_reason"] == "length"
    timing = finish[0]["specbench"]["timing"]
    assert timing["verify_s"] > 0 and timing["step_s"] >= timing["verify_s"]
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    reply = httpx.post(f"{local.url}/v1/chat/completions", json={**body, "stream": False}, timeout=120)
    assert json.loads(reply.headers["x-specbench-timing"])["verify_s"] > 0


def test_seeded_sampling_is_reproducible_and_stop_strings_cut(local):
    client = local.client()
    ask = lambda seed: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a dragon."}], max_tokens=20,
        temperature=0.9, top_p=0.95, seed=seed, extra_body=speculative("chain", 3)).choices[0].message.content
    first = ask(7)
    assert ask(7) == first
    assert len({ask(seed) for seed in (1, 2, 3)} | {first}) > 1  # the seed is what fixes it
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]


def test_a_seed_gives_one_text_under_target_only_lookups_suffix_decoding_and_auto(local):
    """Those methods' sampled requests run sample-match (engine.request_sampling): the target draws each
    position from the seed alone, so the text is target-only's whatever drafted it, however the shared
    suffix cache grew in between (the repeated suffix request recalls the first one's output: it accepts
    more, and still returns the same text)."""
    client = local.client()

    def ask(method):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a dragon."}], max_tokens=20,
            temperature=0.9, seed=11, extra_body=speculative(method, None))
        return reply.choices[0].message.content, reply.usage.speculative["accepted_tokens"]

    reference, _ = ask("target-only")
    replies = [ask(method) for method in ("prompt-lookup", "suffix", "auto", "suffix")]
    assert [text for text, _ in replies] == [reference] * 4
    assert replies[3][1] > replies[1][1]  # the cache changed the drafts, not the text


def test_a_draft_models_sampled_requests_keep_rejection():
    """Rejection accepts more of a draft model's drafts (sum min(p, q) against sum p*q), whose drafts depend on
    the request alone; anything reading the shared cache, routed, or a dynamic tree (which rejection cannot
    verify) runs sample-match."""
    from specbench.methods import get_method
    from specbench.serve.engine import request_sampling
    from specbench.types import SamplingParams

    sampled = SamplingParams(temperature=0.9, rule="rejection")
    rules = {(name, routed): request_sampling(sampled, get_method(name), routed).rule
             for name in ("target-only", "chain", "fixed-tree", "tree", "eagle-tree", "prompt-lookup", "suffix-tree",
                          "suffix-tree-chain")
             for routed in (False, True)}
    assert {key for key, rule in rules.items() if rule == "rejection"} == {("chain", False), ("fixed-tree", False)}
    assert request_sampling(SamplingParams(), get_method("suffix"), False).effective_rule == "greedy"


BAD = [
    ("not json", {}, 400, None),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, {}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}]}, {}, 400, "model"),
    ({"model": MODEL, "messages": []}, {}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, {}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, {}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, {}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, {}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, {}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, {}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, {}, 400, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "speculative": {"method": "tree"}}, {}, 400,
     "speculative.method"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "speculative": {"method": "chain", "k": 99}},
     {}, 400, "speculative.k"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "speculative": {"method": "suffix", "suffix": {"min_score": -1}}}, {}, 400, "speculative.suffix"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "speculative": {"method": "suffix", "suffix": {"cache": "off"}}}, {}, 400, "speculative.suffix"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "speculative": {"method": "chain", "suffix": {"min_score": 1}}}, {}, 400, "speculative.suffix"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "speculation": {"method": "chain"}}, {}, 400,
     "speculation"),  # a misspelt field this server reads: refused, not run as the default method unsaid
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "extra_body": {"speculative": {"method": "chain"}}}, {}, 400, "extra_body"),  # the client's argument, sent raw
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temprature": 0}, {}, 400, "temprature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": 40}, {}, 400, "top_k"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.2}, {}, 400,
     "repetition_penalty"),
    ({"model": MODEL, "prompt": [0, 1, 10**9]}, {}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 400}, {}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x" * 30_000}, {}, 413, None),
]


def test_bad_requests_are_refused_by_name_and_the_server_keeps_serving(local, errors_logged, expected):
    for body, headers, status, param in BAD:
        route = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        content = body if isinstance(body, str) else json.dumps(body)
        reply = httpx.post(f"{local.url}{route}", content=content, headers={"content-type": "application/json",
                                                                            **headers}, timeout=30)
        assert reply.status_code == status, (body if len(str(body)) < 200 else route, reply.text)
        error = reply.json()["error"]
        assert error["message"] and error["param"] == param, error
    assert httpx.post(f"{local.url}/v1/nowhere", json={}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        local.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    text, _ = chat_text(local.client(), PROMPTS[0], "target-only", None, stream=False)
    assert text == expected["chat"][0]
    others = {"metadata": {"team": "a"}, "store": False, "top_k": -1, "min_p": 0, "user": "u",
              "extra_body": {"trace": 1}}  # fields that pass
    reply = httpx.post(f"{local.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0,
        "max_tokens": TOKENS, **others})
    assert reply.json()["choices"][0]["message"]["content"] == expected["chat"][0]
    assert not errors_logged, [r.getMessage() for r in errors_logged]


def test_a_workers_refusal_reaches_the_client_as_a_status_it_can_act_on():
    from specbench.serve.engine import http_status
    from specbench.worker.client import WorkerError, WorkerUnavailableError

    assert http_status(WorkerError("prompt over the worker's limit", "limit")) == (400, "invalid_request_error")
    assert http_status(WorkerError("another model was loaded", "model-changed")) == (409, "model_changed")
    assert http_status(WorkerUnavailableError("no answer"))[0] == 503
    assert http_status(SpecbenchError("anything else"))[0] == 500


def test_api_key_and_a_full_server_answer_401_and_429(remote):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 64,
            "temperature": 0, "stream": True}
    assert httpx.post(f"{remote.url}/v1/chat/completions", json=body).status_code == 401
    assert httpx.post(f"{remote.url}/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    key = {"Authorization": "Bearer sk-test"}
    # one slot, no queue place: of four requests sent at once, one runs and the others are told to retry
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: httpx.post(f"{remote.url}/v1/chat/completions", json=body, headers=key,
                                                     timeout=120), range(4)))
    codes = sorted(reply.status_code for reply in replies)
    assert codes[0] == 200 and codes[-1] == 429, codes
    busy = next(reply for reply in replies if reply.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["code"] == "rate_limit_exceeded"
    assert httpx.post(f"{remote.url}/v1/chat/completions", json={**body, "stream": False}, headers=key,
                      timeout=120).status_code == 200


def test_a_dropped_stream_frees_its_session(local):
    sessions = local.engine._worker.ops.sessions
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": 128, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{local.url}/v1/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        next(lines), next(lines)
        assert local.engine.live == 1
    deadline = time.time() + 30
    while (local.engine.live or sessions.live()) and time.time() < deadline:
        time.sleep(0.05)
    assert local.engine.live == 0 and not sessions.live()


def test_metrics_read_as_vllm_names_them(local):
    chat_text(local.client(), PROMPTS[1], "chain", 3, stream=False)
    text = httpx.get(f"{local.url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    label = f'{{model_name="{MODEL}"}}'
    assert values[f"vllm:spec_decode_num_accepted_tokens_total{label}"] > 0
    assert values[f"vllm:spec_decode_num_draft_tokens_total{label}"] >= \
        values[f"vllm:spec_decode_num_accepted_tokens_total{label}"]
    assert values[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="0"}}'] > 0
    assert values[f"vllm:e2e_request_latency_seconds_count{label}"] >= 1
    assert "vllm:time_to_first_token_seconds_bucket" in text


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (make setup installs them)")
def test_chat_page_streams_a_coloured_reply_and_switches_method(local, expected):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        driver.get(local.url)
        wait = WebDriverWait(driver, 120)
        offered = local.engine.settings.methods  # the page offers every method the server was started with
        wait.until(lambda d: [o.text for o in Select(d.find_element(By.ID, "method")).options] == list(offered))
        for turn, method in enumerate(("chain", "auto", "target-only")):
            Select(driver.find_element(By.ID, "method")).select_by_visible_text(method)
            driver.find_element(By.ID, "max-tokens").clear()
            driver.find_element(By.ID, "max-tokens").send_keys(str(TOKENS))
            box = driver.find_element(By.ID, "message")
            box.send_keys(PROMPTS[0] if turn == 0 else "Thanks!" if turn == 2 else PROMPTS[1])
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: "tok/s" in d.find_elements(By.CSS_SELECTOR, ".stats")[turn].text)
            answer = driver.find_elements(By.CSS_SELECTOR, ".assistant")[turn]
            sources = set(driver.execute_script(
                "return Array.from(arguments[0].querySelectorAll('span')).map(s => s.className)", answer))
            if method == "chain":
                assert driver.execute_script("return arguments[0].textContent", answer) == expected["chat"][0]
                assert sources == {"draft", "target"}, sources
                driver.save_screenshot(str(SHOTS / "serve_chat_chain.png"))
            elif method == "target-only":
                assert sources == {"target"}, sources
                driver.save_screenshot(str(SHOTS / "serve_chat_target_only.png"))
            stats = driver.find_elements(By.CSS_SELECTOR, ".stats")[turn].text
            assert f"({method}" in stats and "tokens per step" in stats
        # target-only is selected last: the shipped SmolLM2 profile prices it
        assert "tok/s" in driver.find_element(By.ID, "predicted").text and "per 1M tokens" in stats
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()


@pytest.mark.parametrize("changes,words", [
    ({"methods": ()}, "offer at least one method"),
    ({"k": 0}, r"k must be in 1..max_k"),
    ({"port": 99_999}, "port must be in 0..65535"),  # before: uvicorn's OverflowError after the models loaded
    ({"methods": ("server-only",)}, "runs wholly on a worker"),
    ({"stop_below": 1.0}, r"stop_below is a probability in \[0, 1\)"),
])
def test_settings_that_cannot_serve_are_refused_by_name_before_any_model_loads(changes, words):
    with pytest.raises(SpecbenchError, match=words):
        ServeSettings(**{"target": MODEL, "methods": ("target-only",), **changes})
