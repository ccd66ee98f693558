"""OpenAI request bodies to engine jobs: every field checked, every refusal naming the field.

Fields the OpenAI API defines but this server does not implement (n > 1, logprobs, penalties) are
refused by name rather than ignored, so a client never gets output it did not ask for; fields that
change nothing here (`user`, `stream_options` besides include_usage, fields of other servers) pass,
except a misspelling of a field this server reads (`speculation` for `speculative`), refused naming both,
and a raw `extra_body` holding fields it reads (the openai client merges that argument into the body).
"""
from __future__ import annotations

import difflib
from numbers import Real
from typing import Any, Optional

from specbench.serve.engine import Job
from specbench.serve.settings import RequestError, ServeSettings, Speculation
from specbench.types import SamplingParams

UNSUPPORTED = {"n": 1, "logprobs": None, "top_logprobs": None, "best_of": 1, "echo": False, "suffix": None,
               "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None,
               "tool_choice": None, "functions": None, "response_format": None,
               # vLLM's and SGLang's sampling extras, which their clients send: each would change the output
               "top_k": -1, "min_p": 0, "repetition_penalty": 1, "min_tokens": 0, "ignore_eos": False}
OFF = {"top_k": (0,)}  # further values that mean "not used"
READ = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
        "stream", "stream_options", "speculative", "user"}
ROLES = ("system", "user", "assistant", "developer")


def completion_job(body: dict, settings: ServeSettings, tokenizer, engine) -> tuple[Job, bool, bool]:
    """`/v1/completions`: one prompt (text, or token ids) -> (job, stream, include_usage)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"] if prompt else []
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise RequestError("prompt must be one string or one list of token ids (send one prompt per request)",
                           "prompt")
    return _job(body, settings, engine.check_prompt(ids), default_max_tokens=16)


def chat_job(body: dict, settings: ServeSettings, tokenizer, engine) -> tuple[Job, bool, bool]:
    """`/v1/chat/completions`: the messages through the target's own chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content}", "messages")
    cleaned = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"messages[{index}] needs a role of {ROLES}", f"messages[{index}].role")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{index}].content parts must all be text", f"messages[{index}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{index}].content must be a string", f"messages[{index}].content")
        cleaned.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(cleaned, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer("\n".join(f"{m['role']}: {m['content']}" for m in cleaned) + "\nassistant:")["input_ids"]
    return _job(body, settings, engine.check_prompt(ids), default_max_tokens=settings.limits.max_tokens,
                max_field="max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")


def _job(body: dict, settings: ServeSettings, prompt_ids: list[int], default_max_tokens: int,
         max_field: str = "max_tokens") -> tuple[Job, bool, bool]:
    limits = settings.limits
    for name, default in UNSUPPORTED.items():
        value = body.get(name, default)
        if value not in (default, None, *OFF.get(name, ())) and value is not False:
            raise RequestError(f"{name}={value!r} is not supported by this server", name)
    for name in body:
        # a field no one reads passes (clients send their own), unless it is a misspelling of one this server
        # reads: "speculation" would otherwise run the default method unsaid
        close = [] if name in READ or name in UNSUPPORTED else difflib.get_close_matches(name, READ, 1, 0.8)
        if close:
            raise RequestError(f"unknown field {name!r}: did you mean {close[0]!r}?", name)
    nested = body.get("extra_body")
    if isinstance(nested, dict) and any(name in READ or name in UNSUPPORTED for name in nested):
        # the openai client's argument, merged into the body by the client; sent as a field, its speculative
        # (or temperature) would be passed over and the request run on defaults, unsaid
        raise RequestError(f"extra_body is the openai client's argument, which it merges into the request body: sent "
                           f"raw, put {sorted(nested)} at the top level of the body", "extra_body")
    max_tokens = body.get(max_field)
    max_tokens = min(default_max_tokens, limits.max_tokens) if max_tokens is None else max_tokens
    _integer(max_tokens, max_field, 1, limits.max_tokens)
    temperature = _number(body.get("temperature", 1.0), "temperature", 0.0, 2.0)
    top_p = _number(body.get("top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p == 0:
        raise RequestError("top_p must be > 0", "top_p")
    seed = body.get("seed")
    if seed is not None:
        _integer(seed, "seed", -(2**63), 2**63 - 1)
        seed %= 2**62
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop) or len(stop) > limits.max_stop:
        raise RequestError(f"stop must be a string or a list of at most {limits.max_stop} strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    sampling = SamplingParams() if temperature == 0 else SamplingParams(temperature=float(temperature),
                                                                         top_p=float(top_p), rule="rejection")
    job = Job(prompt_ids, max_tokens, Speculation.from_request(body.get("speculative"), settings), sampling, seed,
              tuple(stop))
    return job, stream, bool(options.get("include_usage", False))


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        raise RequestError("model is required (GET /v1/models lists it)", "model")
    if model != served:
        raise RequestError(f"the model {model!r} does not exist on this server; it serves {served!r}", "model",
                           status=404, code="model_not_found")


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer in {low}..{high}, got {value!r}", name)
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not low <= value <= high:
        raise RequestError(f"{name} must be a number in {low:g}..{high:g}, got {value!r}", name)
    return float(value)


def error_body(message: str, param: Optional[str] = None, code: str = "invalid_request_error",
               kind: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind or code, "param": param, "code": code}}
