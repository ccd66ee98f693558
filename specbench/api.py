"""The three-line notebook API: `run(target=..., draft=..., method=..., prompts=...) -> DataFrame`."""
from __future__ import annotations

import hashlib
import numbers
import time
import uuid
import warnings
from dataclasses import asdict, replace
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import pandas as pd
from tqdm.auto import tqdm

from specbench.decode.divergence import NEAR_TIE_SHARE, divergence
from specbench.decode.loop import Decoding, generate
from specbench.decode.step import ProactiveDrafting, speculative_step
from specbench.decode.suffix_repeats import COLUMN as REPEAT_COLUMN, held_prompt, repeat_note
from specbench.decode.target import LocalTarget, Target
from specbench.hardware import machine_of, peak_memory_bytes, reset_peak_memory
from specbench.methods import DraftSource, Method, TreeShape, check_runnable, get_method, parse_methods
from specbench.models.loaded import LoadedModel
from specbench.models.loading import as_loaded
from specbench.models.spec import ModelSpec
from specbench.plan.step_planner import planner_note
from specbench.types import STOP_BELOW, SamplingParams, SpecbenchError, check_stop_below

ModelLike = Union[str, ModelSpec, LoadedModel]
__all__ = ["run", "outputs", "divergences", "encode_prompts", "as_target", "TreeShape", "ModelLike"]


def as_target(target: Union[ModelLike, Target], dtype: str = "float32",
              fast: bool | str | None = None) -> tuple[Target, Optional[LoadedModel]]:
    """Any target the user may pass, as a Target plus its weights when they live in this process
    (`fast` applies to one built here; a LocalTarget passed in keeps its own)."""
    if isinstance(target, (str, ModelSpec, LoadedModel)):
        loaded = as_loaded(target, dtype)
        return LocalTarget(loaded, fast=fast), loaded
    if isinstance(target, LocalTarget):
        return target, target.loaded
    return target, None


def _prompt_list(prompts) -> list:
    """`run`'s prompts as a list: one text or dataset row is one prompt (a string was read as one prompt per
    character); a flat list of ids, or no prompts at all, is refused naming what to pass."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise SpecbenchError(f"prompts must be texts, token-id lists or dataset rows, got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise SpecbenchError("no prompts to run")
    if all(isinstance(prompt, numbers.Integral) for prompt in prompts):
        raise SpecbenchError(f"prompts is one list of {len(prompts)} integers: pass [ids] for one prompt of token "
                             f"ids, a list of such lists for several")
    return prompts


def encode_prompts(prompts: Sequence[Union[str, Sequence[int]]], tokenizer, chat: bool = True) -> list[list[int]]:
    """Strings become token ids (through the chat template when the tokenizer has one); ids pass; a dataset
    row (`load_prompts`) is read as its "prompt" text."""
    encoded = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, dict):
            if not isinstance(prompt.get("prompt"), str):
                raise SpecbenchError(f"prompt {index} is a dict without a 'prompt' text (keys {sorted(prompt)[:8]}): "
                                     f"pass texts, token ids, or rows of load_prompts")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise SpecbenchError(
                    f"prompt {index} is text but the target has no tokenizer (a RemoteTarget's worker sent none: "
                    f"its model has none, or the worker is older than the op): pass token ids, or a tokenizer, "
                    f"e.g. run(..., tokenizer=load_tokenizer(name)) "
                    f"or RemoteTarget(endpoint, tokenizer=load_tokenizer(name)), with load_tokenizer from "
                    f"specbench.models.loading and name the worker's model")
            if chat and getattr(tokenizer, "chat_template", None):
                prompt = tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, Iterable):
            ids = list(prompt)
        else:
            raise SpecbenchError(f"prompt {index} is {prompt!r}: pass a text, a list of token ids or a dataset row")
        if not ids:
            raise SpecbenchError(f"prompt {index} is empty")
        encoded.append(ids)
    return encoded


def run(target: Union[ModelLike, Target], prompts: Sequence[Union[str, Sequence[int]]],
        method: Union[str, Iterable[str]] = "chain", draft: Optional[ModelLike] = None, k: int = 4,
        max_new_tokens: int = 64, sampling: Optional[SamplingParams] = None, seed: int = 0,
        self_draft_layers: Optional[int] = None, substitute_quantization: str = "8bit",
        dtype: str = "float32", chat: bool = True, warmup: bool = True, progress: bool | str = True,
        tokenizer=None, tree: TreeShape = TreeShape(), proactive: bool = False, planner=None,
        cross_tokenizer: str = "auto", fast: bool | str | None = None, suffix=None, router=None,
        families: Optional[Sequence[str]] = None, wrap_drafter=None, stop_below: float = STOP_BELOW,
        drafts: Optional[Mapping[str, ModelLike]] = None) -> pd.DataFrame:
    """Run each method over each prompt and return one row per speculative step.

    `prompts` are texts (through the chat template), token ids, or dataset rows (`load_prompts`: their "prompt",
    and their "set" as `families` unless given); a RemoteTarget brings its worker's tokenizer for text.
    `target` is a catalog name, Hugging Face id, path, ModelSpec, LoadedModel, LocalTarget or
    RemoteTarget; methods come from the method table (`specbench.methods`), each at `k` or at its own K
    ("chain:3") and with `draft` or its own ("chain:3@smollm2-135m": a key of `drafts`, else a model name, loaded
    once in the run's dtype; its records' `method` is "chain@smollm2-135m"). For tree methods K is the node budget.
    Every method shares the target and the loop, so tokens are counted identically;
    a short warm-up generation per method is run first and discarded. Methods are interleaved: each runs a
    prompt before the next prompt starts, in an order rotated per prompt, so a machine that slows or speeds up
    during the call weighs on all of them alike (every method's drafter stays built for the whole call).
    Output ids per (method, prompt) come back through `outputs(df)`. `proactive` drafts ahead while a remote
    verify is in flight (methods that draft a chain from a model). A `planner` picks K per step up to `k` for
    plannable methods (AutoDraft's per-step choice), starting each prompt from its reference prior;
    those runs are labelled "<method>+planner" and have `planned` set. A draft whose tokenizer is not
    the target's is translated through text (`cross_tokenizer`: auto, text, shared-vocab; 'off'
    refuses it); its rows say which rule ran (`cross_tokenizer`) and how many draft tokens it took.
    `progress`: a bar over methods x prompts (a string labels it, e.g. with the setting being run).
    `fast` (True, or a backend: compile, cudagraph, compiled-graph, static) runs the target and a chain draft
    model in fixed-shape steps over static caches (`decode/fast_forward.py`): the same tokens, less overhead;
    the default (None) does so for unquantized CUDA models only, and not with a draft head (eagle methods read
    the target's hidden states, which fast steps do not expose), False or "off" never.
    `suffix` (a `SuffixSettings`, or a dict of its fields) shapes the suffix methods, whose `k` is a cap: their counts choose each step's
    draft, and their cache of earlier outputs is shared per process by default (`cache="drafter"`: within
    this call's prompts only; "off": each prompt drafts from itself). A call comparing two or more methods that
    keep outputs uses "drafter" for them: each learns from its own earlier prompts of the call, never from another
    method's output of the prompt it is drafting (on a worker, each method of the call a cache of its own there).
    Method "auto" routes each prompt to the method and K a `router` (`specbench.route`) predicts fastest for it
    (`families`: each prompt's family, when known, which the router may use); its rows say what was chosen.
    `stop_below` ends a `chain-confident` (or `suffix-tree-chain-confident`) chain after a token its draft gave
    less than this probability (K its cap; 0.4 is Hugging Face's assisted generation default). `wrap_drafter` is
    given each drafter built and returns the one to use: e.g. recording its proposals, or replaying recorded ones
    as clients on other hosts would (`decode/replay_drafter.py`).
    """
    sampling = sampling or SamplingParams()
    prompts = _prompt_list(prompts)
    asked = [method] if isinstance(method, str) else list(method) if isinstance(method, Iterable) else []
    if not asked:
        raise SpecbenchError(f"method must name one method or several (specbench.methods), got {method!r}")
    choices = parse_methods(asked, k)
    names = [choice.name for choice in choices]
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):  # "a" met torch's OverflowError
        raise SpecbenchError(f"seed must be a whole number, got {seed!r}")
    check_stop_below(stop_below)  # before any model loads
    if "auto" in names and router is None:
        raise SpecbenchError("method 'auto' routes each prompt to a method and K: pass router=... (a Router from "
                             "specbench.route.auto.train_router, or Router.load(path))")
    methods = [None if name == "auto" else get_method(name) for name in names]
    if fast is None and any(chosen is not None and chosen.reads_features for chosen in methods):
        fast = False  # the default (fast on CUDA) yields to a draft head, which reads the target's hidden states
    target, target_model = as_target(target, dtype, fast)
    if planner is not None and (note := planner_note(planner, target)):
        warnings.warn(note, stacklevel=2)
    for chosen, choice in zip(methods, choices):
        if chosen is not None:
            check_runnable(chosen, target, planner)
        if planner is not None and choice.draft and chosen.plannable:
            raise SpecbenchError(f"a step planner prices the draft of its reference; method {choice.label!r} drafts "
                                 f"with its own: run it without planner=")
    if families is None and prompts and all(isinstance(prompt, dict) and "set" in prompt for prompt in prompts):
        families = [str(prompt["set"]) for prompt in prompts]  # dataset rows name their family
    texts = any(isinstance(prompt, (str, dict)) for prompt in prompts)  # ids need none (a RemoteTarget fetches one)
    prompt_ids = encode_prompts(prompts, tokenizer or (target.tokenizer if texts else None), chat)
    if families is not None and len(families) != len(prompt_ids):
        raise SpecbenchError(f"families name {len(families)} prompts' families for {len(prompt_ids)} prompts")
    source = DraftSource(target, target_model, draft, dtype, self_draft_layers, substitute_quantization, tree,
                         cross_tokenizer, fast, suffix, stop_below)
    # auto keeps outputs through any of its candidates
    keeping = [chosen.keeps_outputs if chosen is not None else router.keeps_outputs for chosen in methods]
    if sum(keeping) > 1 and source.suffix.cache == "process":  # methods compared in one call: none may draft a
        source = replace(source, suffix=replace(source.suffix, cache="drafter"))  # prompt from another's output of it
    if source.suffix.cache == "drafter" and not source.suffix.name:  # a worker keeps this call's caches by its name
        source = replace(source, suffix=replace(source.suffix, name=f"run-{uuid.uuid4().hex[:12]}"))
    rows = []
    label = progress if isinstance(progress, str) else f"run {len(methods)} methods x {len(prompt_ids)} prompts"
    bar = tqdm(total=len(methods) * len(prompt_ids), desc=label, unit="prompt", disable=not progress)
    described = getattr(target, "info", None)  # a RemoteTarget's worker description
    target_bytes = target_model.weight_bytes if target_model else (
        described.get("weight_bytes") if isinstance(described, dict) else None)
    device = str(target.device) if target_model else None  # a remote worker's peak is its own
    shared = dict(target=target, source=source, prompt_ids=prompt_ids, k=k, max_new_tokens=max_new_tokens,
                  sampling=sampling, seed=seed, warmup=warmup, draft=draft, bar=bar, device=device,
                  target_bytes=target_bytes, wrap=wrap_drafter or (lambda drafter: drafter), families=families)
    drafts_for = draft_resolver(draft, drafts, dtype)
    runs = [_auto_run(router, drafts_for, **shared) if chosen is None else
            _method_run(chosen, planner, proactive, choice.label, **_own_draft(shared, chosen, choice, drafts_for))
            for chosen, choice in zip(methods, choices)]
    for index in range(len(prompt_ids)):  # every method on a prompt before the next prompt, in an order rotated
        turn = index % len(runs)  # per prompt: the machine's drift during the call weighs on all methods alike
        for one_prompt in runs[turn:] + runs[:turn]:
            rows += one_prompt(index)
            bar.update()
    bar.close()
    records = pd.DataFrame(rows)
    if note := repeat_note(records):
        warnings.warn(note, stacklevel=2)
    return records


def draft_resolver(draft, drafts, dtype: str) -> Callable:
    """What a method's own draft ("chain@NAME") is: `drafts[NAME]` or NAME as a model, loaded once per name in
    this process where the method drafts with a model here (a worker's method or a head's folder goes as named)."""
    drafts = dict(drafts or {})
    loaded: dict = {}

    def draft_for(name: Optional[str], method: Method):
        if name is None:
            return draft
        given = drafts.get(name, name)
        if method.on_worker or method.reads_features or method.kind == "none" or method.lookup:
            return given
        if name not in loaded:
            loaded[name] = as_loaded(given, dtype)
        return loaded[name]

    return draft_for


def _own_draft(shared: dict, method: Method, choice, drafts_for) -> dict:
    """`shared` for one method: its K, and its own draft where it names one. A call's suffix caches ("drafter")
    are named per method on a worker; a method with its own draft names one apart ("suffix-eagle-server@B" must
    not draft from "...@A"'s outputs of the same prompts)."""
    if choice.draft is None:
        return dict(shared, k=choice.k)
    draft, suffix = drafts_for(choice.draft, method), shared["source"].suffix
    if suffix.cache == "drafter":
        suffix = replace(suffix, name=f"{suffix.name}@{hashlib.sha1(choice.draft.encode()).hexdigest()[:10]}")
    return dict(shared, k=choice.k, draft=draft, source=replace(shared["source"], draft=draft, suffix=suffix))


def _method_run(chosen, planner, proactive, label, *, target, source, prompt_ids, k, max_new_tokens, sampling, seed,
                warmup, draft, bar, device, target_bytes, wrap, families) -> Callable[[int], list[dict]]:
    """Build `chosen`'s drafter and warm it up; return what runs prompt `index` through it (its step rows)."""
    drafter = wrap(chosen.build(source)) if chosen.build else None
    planned = planner if chosen.plannable else None  # baselines in the same call run as they are
    decoding = Decoding(k, max_new_tokens, sampling, f"{label}+planner" if planned else label, chosen.kind, planned)
    one = dict(target=target, method=chosen, drafter=drafter, decoding=decoding, draft=draft,
               proactive=proactive and chosen.drafts_ahead, suffix=source.suffix)
    if warmup:
        _warm_up(prompt_ids[0], seed, one, source)

    def run_prompt(index: int) -> list[dict]:
        bar.set_postfix_str(f"{label}, k={k}, {max_new_tokens} tokens")
        if planned is not None:
            planned.reset()
        routed = chosen.name == "auto-server" and families is not None  # the worker's router may use the family
        held = held_prompt(drafter, prompt_ids[index])
        result = _measured(prompt_ids[index], index, seed, device, dict(one, family=families[index]) if routed else one)
        rows = _rows(result, prompt_ids[index], 0 if chosen.kind == "none" else k, _memory(drafter, target_bytes), held)
        return [dict(row, method=label) for row in rows] if chosen.on_worker and label != chosen.name else rows

    return run_prompt


def _auto_run(router, drafts_for, *, target, source, prompt_ids, k, max_new_tokens, sampling, seed, warmup, draft, bar,
              device, target_bytes, wrap, families) -> Callable[[int], list[dict]]:
    """What runs prompt `index` through the method and K the router predicts best for it; each row says what was
    chosen, how long choosing took, and every candidate's predicted tokens/s (the reason)."""
    import json

    from specbench.decode.suffix_drafter import new_cache
    from specbench.methods import suffix_cache
    from specbench.route.features import seen_share
    from specbench.route.router import predicted_speeds

    for note in (router.length_note(max_new_tokens), router.machine_note(machine_of(target))):
        if note:
            warnings.warn(note, stacklevel=4)
    built: dict = {}
    history: list[tuple] = []  # this call's (prompt, output)s, for a suffix drafter built after some of them ran
    # what earlier outputs hold, for the router's seen share: the suffix candidates' shared cache, or this call's own
    # (each suffix drafter keeps its own when several methods share the call)
    memory = None
    if router.keeps_outputs and source.suffix.cache != "off":
        memory = suffix_cache(source)
        memory = new_cache(source.suffix) if memory is None else memory  # (an empty cache is falsy: no `or`)

    def prepared(candidate):
        if candidate not in built:
            method = get_method(candidate.method)
            check_runnable(method, target, None)
            own = drafts_for(candidate.draft, method)  # the candidate's own draft, or the run's
            own_source = source if candidate.draft is None else replace(source, draft=own)
            decoding = Decoding(max(1, candidate.k), max_new_tokens, sampling, "auto", method.kind)
            built[candidate] = one = dict(target=target, method=method, decoding=decoding, draft=own,
                                          drafter=wrap(method.build(own_source)) if method.build else None,
                                          proactive=False, suffix=source.suffix)
            if warmup:
                _warm_up(prompt_ids[0], seed, one, own_source)
            # a cache of its own (not the shared one `memory` is) starts with every earlier output of the call
            if hasattr(one["drafter"], "remember") and getattr(one["drafter"], "cache", None) is not memory:
                for ids, output in history:
                    one["drafter"].remember(output, ids)
        return built[candidate]

    def run_prompt(index: int) -> list[dict]:
        bar.set_postfix_str(f"auto over {len(router.candidates)} candidates, {max_new_tokens} tokens")
        ids = prompt_ids[index]
        started = time.perf_counter()
        family = families[index] if families is not None else None
        candidate, table = router.choose(ids, family, seen_share(ids, memory) if router.reads_seen else 0.0)
        route_s = time.perf_counter() - started
        one = prepared(candidate)
        held = held_prompt(one["drafter"], ids)
        result = _measured(ids, index, seed, device, one)
        history.append((ids, list(result.output_ids)))
        fed = {id(getattr(one["drafter"], "cache", None))}  # a cache that keeps outputs sees every prompt's once
        for other in built.values():
            cache = getattr(other["drafter"], "cache", None)
            if hasattr(other["drafter"], "remember") and id(cache) not in fed:
                other["drafter"].remember(result.output_ids, ids)
                fed.add(id(cache))
        if memory is not None and id(memory) not in fed and result.output_ids:
            memory.extend(memory.open(ids), list(result.output_ids))
        why = json.dumps(predicted_speeds(table))
        return [dict(row, method="auto", chosen=candidate.label, route_s=route_s, route_predicted=why,
                     route_default=router.default_for(family))
                for row in _rows(result, ids, candidate.k if one["method"].kind != "none" else 0,
                                 _memory(one["drafter"], target_bytes), held)]

    return run_prompt


def _warm_up(ids, seed, one, source) -> None:
    """A short generation first, discarded. A drafter that keeps outputs (suffix decoding) warms up as a copy
    that keeps none, so the first prompt's own output is not in the cache before it runs."""
    drafter, suffix = one["drafter"], one["suffix"]
    if hasattr(drafter, "remember"):
        drafter = one["method"].build(replace(source, suffix=replace(source.suffix, cache="off")))
    if one["method"].on_worker and one["method"].keeps_outputs:  # the worker's cache, too, keeps no warm-up
        suffix = replace(suffix, cache="off")
    decoding = replace(one["decoding"], max_new_tokens=min(8, one["decoding"].max_new_tokens))
    _generate_one(ids, 0, seed, **dict(one, drafter=drafter, decoding=decoding, suffix=suffix))


def _measured(ids, index, seed, device, one):
    reset_peak_memory(device)
    result = _generate_one(ids, index, seed * 1_000_003 + index, **one)
    result.peak = peak_memory_bytes(device)
    return result


def _rows(result, ids, k, memory, held: Optional[bool] = None) -> list[dict]:
    """`held`: whether a suffix cache already held an output of this prompt (None: the drafter keeps none)."""
    route = getattr(result, "route", None) or {}  # a worker that routed the prompt says what it chose
    extra = {**route, **({} if held is None else {REPEAT_COLUMN: held})}
    return [{**asdict(record), "k": k, "prompt_tokens": len(ids), "prefill_s": result.prefill_s, **memory,
             "device_peak_bytes": result.peak, **extra} for record in result.records]


def _memory(drafter, target_bytes) -> dict:
    return {"target_weight_bytes": target_bytes,  # as loaded; a remote worker reports its own
            "draft_weight_bytes": drafter.draft.weight_bytes if isinstance(getattr(drafter, "draft", None),
                                                                         LoadedModel) else None}


def _generate_one(ids, prompt_index, seed, *, target, method, drafter, decoding, draft, proactive, suffix=None,
                  family=None):
    """One prompt through one method; worker methods run wholly on the worker (with `suffix`'s step knobs;
    `family`: the prompt's, for a worker that routes it)."""
    if method.on_worker:
        draft_spec = ModelSpec(draft) if isinstance(draft, str) else draft if isinstance(draft, ModelSpec) else None
        return target.generate_on_worker(method.name, ids, k=decoding.k, max_new_tokens=decoding.max_new_tokens,
                                         sampling=decoding.sampling, seed=seed, prompt_index=prompt_index,
                                         draft=draft_spec, suffix=suffix if method.keeps_outputs else None,
                                         **({"family": family} if family is not None else {}))
    step = ProactiveDrafting() if proactive else speculative_step
    return generate(target, drafter, ids, decoding, seed=seed, prompt_index=prompt_index, step=step)


def outputs(records: pd.DataFrame) -> dict[tuple[str, int], list[int]]:
    """Generated token ids per (method, prompt_index), rebuilt from the step records."""
    result: dict[tuple[str, int], list[int]] = {}
    for (method, prompt), group in records.groupby(["method", "prompt_index"], sort=False):
        result[(method, prompt)] = [t for tokens in group.sort_values("step")["emitted_tokens"] for t in tokens]
    return result


def divergences(records: pd.DataFrame, target: Union[ModelLike, LocalTarget],
                prompts: Sequence[Union[str, Sequence[int]]],
                reference: Optional[pd.DataFrame] = None, dtype: str = "float32", chat: bool = True,
                tolerance: float = NEAR_TIE_SHARE) -> pd.DataFrame:
    """One row per (method, prompt) whose greedy output is not target-only's: the first differing token, the
    target's logits of both tokens there (teacher-forced) and whether that is a near-tie (`near_tie`: rounding
    of a wider verify, bf16 or a batch; False is a bug). `records` and `prompts` as run() had them; target-only's
    outputs come from `reference` (default: `records`). Pass the target as run, in its dtype (a LoadedModel or
    LocalTarget keeps its own)."""
    if isinstance(target, LocalTarget):
        loaded = target.loaded
    else:
        loaded = as_loaded(target, dtype) if isinstance(target, (str, ModelSpec, LoadedModel)) else None
    if loaded is None:
        raise SpecbenchError(f"divergences needs the target's weights in this process to read its logits, not a "
                             f"{type(target).__name__}: pass its name or LoadedModel (in the dtype it ran in)")
    got, expected = outputs(records), outputs(records if reference is None else reference)
    prompt_ids = encode_prompts(prompts, loaded.tokenizer, chat=chat)
    decode = (lambda token: None if token is None or loaded.tokenizer is None else loaded.tokenizer.decode([token]))
    rows = []
    order = {method: place for place, method in enumerate(dict.fromkeys(method for method, _ in got))}
    for (method, index), tokens in sorted(got.items(), key=lambda item: (order[item[0][0]], item[0][1])):
        if (method == "target-only" and reference is None) or ("target-only", index) not in expected:
            continue
        found = divergence(loaded.model, prompt_ids[index], expected[("target-only", index)], tokens, tolerance)
        if found is not None:
            rows.append({"method": method, "prompt_index": index, **asdict(found),
                         "expected_text": decode(found.expected_token), "got_text": decode(found.got_token)})
    columns = ["method", "prompt_index", "position", "expected_token", "got_token", "expected_text", "got_text",
               "expected_logit", "got_logit", "share_of_range", "near_tie"]
    return pd.DataFrame(rows, columns=columns)
