"""The worker's long requests, `profile` and server-only `generate`: validated, then run as jobs a
bounded slice at a time (`jobs.py`), so one tenant's long request never holds the others longer than
a slice. `ops` is the worker's `Ops`: its limits, model, draft, job queue and stored replies.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
from collections import OrderedDict
from dataclasses import asdict
from typing import Optional

import numpy as np

from specbench.methods import METHODS
from specbench.models.spec import ModelSpec
from specbench.types import SpecbenchError
from specbench.worker import protocol
from specbench.worker.jobs import Job
from specbench.worker.limits import check
from specbench.worker.protocol import MAX_SEED, ProtocolError, field as get

MAX_FAMILY_CHARS = 200  # auto-server's `family`: a dataset family's name, not a payload


def profile(ops, header: dict, curve_key: str) -> Job:
    """The forward-latency grid on the worker's hardware, in pieces of at most `--slice-tokens`
    tokens (a piece of a context being built, or one timed repeat), other clients served between."""
    from specbench.decode.profile import forward_latency_steps

    tokens = protocol.int_list(header, "tokens", 1, [1, 2, 4, 8, 16])
    contexts = protocol.int_list(header, "contexts", 1, [128, 512])
    repeats = protocol.integer(header, "repeats", 1, None, 5)
    batches = protocol.int_list(header, "batches", 1, [1])
    limits = ops.limits
    check(len(tokens) * len(contexts) * len(batches), limits.max_profile_points, "profile grid points",
          "--max-profile-points")
    check(max(batches, default=1), limits.max_sessions, "profile batch size", "--max-sessions")
    check(repeats, limits.max_profile_repeats, "profile repeats", "--max-profile-repeats")
    check(max(tokens, default=0), limits.max_tree_nodes, "profile tokens per forward", "--max-tree-nodes")
    check(max(contexts, default=0), limits.max_prompt_tokens, "profile context", "--max-prompt-tokens")
    # one timed forward is one slice: the grid's largest must fit, or it would hold every other client
    check(max(tokens, default=0) * max(batches, default=1), ops.config.slice_tokens,
          "profile tokens x batch in one forward", "--slice-tokens")
    principal = ops.check_jobs(header, curve_key)
    target = ops.ensure_loaded()
    if target.max_context:
        check(max(tokens, default=0) + max(contexts, default=0), target.max_context,
              "profile context + tokens", "the model's context length")
    ops.check_kv(incoming=max(batches, default=1) * (max(contexts, default=0) + max(tokens, default=0)),
                   what="this profile point's caches")
    # several sequences on a packed target are timed as its batched verifies run: packed rows of its pool
    packed = [b for b in batches if b > 1] if target.packed and target.fast is None else []
    steps = forward_latency_steps(target.model, tokens, contexts, repeats,
                                  batches=[b for b in batches if b not in packed],
                                  fast=target.fast.backend if target.fast else None,
                                  slice_tokens=ops.config.slice_tokens)
    if packed:
        from specbench.decode.profile_packed import packed_batch_steps

        steps = itertools.chain(steps, packed_batch_steps(target, tokens, contexts, repeats, batches=packed,
                                                          slice_tokens=ops.config.slice_tokens,
                                                          longest=limits.max_prompt_tokens))

    def run():
        rows = []
        for row in steps:  # one bounded piece per slice
            if row is not None:
                rows.append(row)
            yield
        return {"rows": rows, **ops.describe()}, None

    return Job(run(), principal=principal, op="profile", busy=ops.stats.add_busy)


def generate(ops, header: dict, arrays: dict, curve_key: str):
    """Server-only baselines: the worker drafts and verifies itself, and returns finished tokens. The
    prompt goes in `--slice-tokens` at a time and then a step per slice; a resend of the same request
    (its `request` key) joins the job under way or gets its stored reply, so it runs once."""
    from specbench.decode.loop import Decoding, generate_steps
    from specbench.decode.suffix_repeats import held_prompt

    method, chosen = get(header, "method", str), {}
    limits = ops.limits
    max_new_tokens = protocol.integer(header, "max_new_tokens", 1)
    check(max_new_tokens, limits.max_new_tokens, "max_new_tokens of a generate", "--max-new-tokens")
    if method == "auto-server":  # the worker's router picks the method and K for this prompt
        family = get(header, "family", str) if "family" in header else None
        if family is not None and len(family) > MAX_FAMILY_CHARS:
            raise ProtocolError(f"field 'family' is a family's name: at most {MAX_FAMILY_CHARS} characters, "
                                f"got {len(family)}")
        method, k_chosen, chosen, routed_draft = _routed(ops, protocol.array(arrays, "tokens").tolist(), family,
                                                         header, curve_key, max_new_tokens)
        header = dict(header, k=k_chosen)
        if routed_draft is not None:  # the chosen candidate's own draft, in the worker's draft dtype
            like = ops.config.draft or ops.config.model or ModelSpec(routed_draft)
            header = dict(header, draft=protocol.spec_to_wire(ModelSpec(routed_draft, dtype=like.dtype,
                                                                        device=ops.config.device)))
    if method not in METHODS or not METHODS[method].on_worker:
        on_worker = [name for name, m in METHODS.items() if m.on_worker]
        raise ProtocolError(f"generate runs the worker methods {on_worker}, not {method!r}")
    k = protocol.integer(header, "k", 1, None, 4)
    suffix = protocol.suffix_from_wire(header["suffix"]) if "suffix" in header else {}
    check_step(method, k, suffix, limits)
    prompt = protocol.array(arrays, "tokens")
    check(len(prompt), limits.max_prompt_tokens, "prompt tokens", "--max-prompt-tokens")
    sampling = protocol.sampling_from_wire(get(header, "sampling", dict))
    seed = protocol.integer(header, "seed", 0, MAX_SEED, 0)
    draft_spec = protocol.spec_from_wire(header["draft"]) if "draft" in header else ops.config.draft
    target = ops.ensure_loaded()
    ops.check_model(header)
    _, principal = ops.owner(header, curve_key)
    key = _generate_key(header, arrays, principal)
    if key is not None:
        running = next((job for job in ops.jobs.jobs if job.key == key and not job.done), None)
        if running is not None:
            return running
        if key in ops.generated:
            reply, out = ops.generated[key]
            return dict(reply, replayed=True), out
    ops.check_jobs(header, curve_key)
    target.check_prompt(prompt.tolist())
    ops.check_kv(incoming=len(prompt) + max_new_tokens + k)
    drafter = None
    if METHODS[method].lookup:  # suffix decoding on the worker: no draft model
        drafter = _suffix_drafter(ops, target, METHODS[method], principal, suffix)
    elif METHODS[method].kind != "none":  # the worker drafts too
        if draft_spec is None:
            raise SpecbenchError("server-only needs a draft model: start the worker with --draft or send one")
        ops.policy.check(draft_spec)
        drafter = _server_drafter(ops, target, METHODS[method], draft_spec, principal, suffix)
    decoding = Decoding(k, max_new_tokens, sampling, method=method, kind=METHODS[method].kind)
    held = held_prompt(drafter, prompt.tolist())  # the tenant's suffix cache held an output of this very prompt
    steps = generate_steps(target, drafter, prompt.tolist(), decoding, seed=seed,
                           session=f"generate/{ops.stats.requests}", prefill_chunk=ops.config.slice_tokens)
    identity = ops.identity

    def run():  # a prompt chunk or a speculative step per slice; closing it closes the target session
        result = yield from steps
        reply = {"records": [asdict(record) for record in result.records], "prefill_s": result.prefill_s,
                 "model": identity, **chosen, **({} if held is None else {"cache_held_prompt": held})}
        out = {"output": np.asarray(result.output_ids, dtype=np.int32)}
        if key is not None:
            ops.generated.store(key, reply, out)
        return reply, out

    return Job(run(), key=key, principal=principal, op="generate", busy=ops.stats.add_busy)


def _server_drafter(ops, target, method, draft_spec, principal: str, suffix: dict):
    """The worker's drafter for a generate: the draft model's (kept between requests; the prompt it drafts
    for is in its context), or, for a head method, a drafter of its own over the kept head (a head drafter
    is bound to one session, and generates of several clients interleave; a hybrid's suffix half drafts
    from the worker's cache, as `_suffix_drafter`'s)."""
    from specbench.methods import DraftSource
    from specbench.models.loading import load_model

    if method.worker_build is not None:
        from specbench.heads.layouts import load_head

        head = ops.heads.get(draft_spec)
        if head is None:
            ops.log(f"loading draft head {draft_spec.label}")
            head = load_head(draft_spec.model, target.loaded)
            ops.heads = {draft_spec: head}  # one head kept, like one draft model
        settings, key = _suffix_scope(ops, principal, suffix)
        return method.worker_build(DraftSource(target, target.loaded, head, suffix=settings), key=key)
    if ops.draft is None or ops.draft.draft.spec != draft_spec:
        ops.log(f"loading draft {draft_spec.label}")
        # through the method table, so a draft with another tokenizer is translated, not misread
        ops.draft = DraftSource(target, target.loaded, load_model(draft_spec)).model_drafter("server-draft")
    return ops.draft


# a method that runs in the client, as the worker runs it itself
ON_WORKER = {"target-only": "server-only-ar", "chain": "server-only", "suffix": "suffix-server",
             "suffix-tree": "suffix-tree-server", "eagle": "eagle-server", "eagle-tree": "eagle-tree-server",
             "suffix-eagle": "suffix-eagle-server", "suffix-eagle-tree": "suffix-eagle-tree-server"}


def check_step(method: str, k: int, suffix: dict, limits) -> None:
    """A generate's `k` against the limits that bound one of its steps (a slice): the draft forwards a step runs
    (k for a draft model or head, a hybrid's head or model at most `other_k` of them, none for suffix decoding's
    lookups) against --max-generate-k, and the draft nodes its verify reads against --max-tree-nodes."""
    from specbench.decode.suffix_drafter import SuffixSettings

    spec = METHODS[method]
    if spec.lookup or spec.kind == "none":
        forwards = 0
    elif spec.keeps_outputs:  # a hybrid: suffix decoding's lookups, or its other drafter's few forwards
        forwards = min(k, suffix.get("other_k", SuffixSettings.other_k))
    else:
        forwards = k
    check(forwards, limits.max_generate_k, f"draft forwards a step of a generate ({method} k={k})",
          "--max-generate-k")
    check(k, limits.max_tree_nodes, f"draft nodes a step of a generate ({method} k={k})", "--max-tree-nodes")


def worker_router(path: str, limits=None):
    """The router file a worker routes auto-server with, refused by name unless every candidate runs on a worker
    (and, given the worker's `limits`, within them: a router whose choice the worker would refuse serves nobody)."""
    from specbench.route.router import Router

    router = Router.load(path)
    runs_there = {name for name, method in METHODS.items() if method.on_worker}
    stranded = [c.label for c in router.candidates if ON_WORKER.get(c.method, c.method) not in runs_there]
    if stranded:
        raise SpecbenchError(f"router {path}: candidates {stranded} have no worker method; a worker's router takes "
                             f"{sorted(ON_WORKER)} (run there as {sorted(ON_WORKER.values())}) and the worker methods")
    for candidate in router.candidates if limits is not None else ():
        try:
            check_step(ON_WORKER.get(candidate.method, candidate.method), max(1, candidate.k), {}, limits)
        except SpecbenchError as error:
            raise SpecbenchError(f"router {path}: candidate {candidate.label} is over this worker's limits "
                                 f"({error}): raise the limit or route with a smaller K") from None
    return router


@functools.lru_cache(maxsize=8)
def router_machine_note(calibrated_on: Optional[str], device: str) -> Optional[str]:
    """Why a worker's router (calibrated on `calibrated_on`, `Router.machine`) may not choose well on this worker
    (its target on `device`): every auto-server candidate drafts and verifies here, so the target's device is
    compared, whichever machine the calibration's loop ran on. None where they match or the file knows none."""
    from specbench.hardware import device_name, target_of
    from specbench.types import machine_note

    return machine_note(target_of(calibrated_on) if calibrated_on else None, device_name(device),
                        "this router's target ran", "calibrate on this worker's machine (`specbench route`, there "
                        "or through this worker)")


def _routed(ops, prompt: list, family: Optional[str], header: dict, curve_key: str,
            max_new_tokens: int) -> tuple[str, int, dict, Optional[str]]:
    """auto-server: the worker method, K and own draft (None: the worker's) its router predicts best for `prompt`,
    and what to tell the client.
    A router that reads what earlier outputs hold reads this tenant's suffix cache (the one the request's suffix
    drafter would draft from)."""
    import json

    from specbench.methods import DraftSource, suffix_cache
    from specbench.route.features import seen_share
    from specbench.route.router import predicted_speeds

    if ops.config.router is None:
        raise ProtocolError("method auto-server needs a router on the worker: start it with --router FILE")
    if ops.router is None:
        ops.router = worker_router(ops.config.router, ops.limits)
    seen = 0.0
    if ops.router.reads_seen and ops.router.keeps_outputs:  # as calibration: 0 where no candidate keeps outputs
        target = ops.ensure_loaded()
        suffix = protocol.suffix_from_wire(header["suffix"]) if "suffix" in header else {}
        settings, key = _suffix_scope(ops, ops.owner(header, curve_key)[1], suffix)
        seen = seen_share(prompt, suffix_cache(DraftSource(target, target.loaded, suffix=settings), key))
    candidate, table = ops.router.choose(prompt, family, seen)
    method = ON_WORKER.get(candidate.method, candidate.method)
    own = f"@{candidate.draft}" if candidate.draft else ""
    told = {"chosen": f"{method}{own} k={candidate.k}", "route_predicted": json.dumps(predicted_speeds(table)),
            "route_default": ops.router.default_for(family)}
    notes = [ops.router.length_note(max_new_tokens), router_machine_note(ops.router.machine, ops.config.device)]
    if any(notes):
        told["route_note"] = "; ".join(note for note in notes if note)
    return method, max(1, candidate.k), told, candidate.draft


def _suffix_drafter(ops, target, method, principal: str, suffix: dict):
    """A suffix drafter per request over the worker's cache of earlier outputs (`_suffix_scope`)."""
    from specbench.methods import DraftSource

    settings, key = _suffix_scope(ops, principal, suffix)
    return method.worker_build(DraftSource(target, target.loaded, suffix=settings), key=key)


NAMED_CACHES_PER_TENANT = 4  # a tenant's own named suffix caches the worker keeps, the least recently used dropped


def _suffix_scope(ops, principal: str, suffix: dict):
    """(suffix settings, cache key) of a request on this worker: a cache per tenant by default
    (`--suffix-cache tenant`), one for all (`shared`), or none (`off`); the request's own step knobs
    (`suffix`, checked by `protocol.suffix_from_wire`) on top. A request may turn its cache off or name a
    cache of its tenant's own (one `run` call's methods each name theirs, so none drafts from another's
    outputs); a tenant keeps `NAMED_CACHES_PER_TENANT` of them, so names cannot grow its memory."""
    from specbench.decode.suffix_drafter import SuffixSettings, drop_process_caches

    knobs = dict(suffix)
    asked = knobs.pop(protocol.SUFFIX_CACHE_FIELD, None)
    scope = ops.config.suffix_cache
    off = scope == "off" or asked == "off"
    settings = SuffixSettings(cache="off" if off else "process", **knobs)
    tenant = ("worker", ops.identity, principal)
    if asked is None or off:
        return settings, tenant[:2] if scope == "shared" else tenant
    names = ops.suffix_names.setdefault(principal, OrderedDict())
    names[asked] = None
    names.move_to_end(asked)
    while len(names) > NAMED_CACHES_PER_TENANT:
        oldest, _ = names.popitem(last=False)
        drop_process_caches(tenant + ("named", oldest))
    return settings, tenant + ("named", asked)


def _generate_key(header: dict, arrays: dict, principal: str) -> Optional[tuple]:
    """What makes two generates one request: the client's `request` name and a digest of the rest."""
    name = protocol.name_field(header, "request") if "request" in header else None
    if name is None:
        return None
    digest = hashlib.sha256(repr(sorted((k, v) for k, v in header.items() if k not in ("id", "client"))).encode())
    digest.update(arrays["tokens"].tobytes())
    return "generate", principal, name, digest.hexdigest()
