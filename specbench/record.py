"""Measure what the planner replays: latency profiles of models on this device, acceptance references of pairs."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specbench.api import ModelLike, TreeShape, run
from specbench.methods import kind_method, lookup_method
from specbench.models.loading import as_loaded
from specbench.models.spec import acceptance_label
from specbench.decode.metrics import reply_position
from specbench.decode.profile import forward_latency_points, spread
from specbench.hardware import device_name, measure_power
from specbench.plan.predict import FREE_DRAFTS, LOOKUP_DRAFT, SUFFIX_DRAFT, AcceptanceReference, LatencyProfile
from specbench.plan.reference import HEAD_HYBRIDS, HYBRIDS, TREE_OTHERS
from specbench.types import SamplingParams

DEFAULT_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64, 96, 128)
DEFAULT_CONTEXTS = (128, 512)


def profile_model(model: ModelLike, tokens: Sequence[int] = DEFAULT_TOKENS,
                  contexts: Sequence[int] = DEFAULT_CONTEXTS, repeats: int = 5,
                  dtype: str = "float32", batches: Sequence[int] = (1,),
                  progress: bool = False, fast: bool | str = False) -> tuple[LatencyProfile, dict]:
    """Forward latency of `model` on its device over the grid (per batch size, for a target shared
    by that many clients), plus metadata (power, device, settings). `fast` (True or a backend):
    profile the fast path instead (batches through its static pool)."""
    from tqdm.auto import tqdm

    loaded = as_loaded(model, dtype)
    device = str(loaded.model.get_input_embeddings().weight.device)
    points = forward_latency_points(loaded.model, tokens, contexts, repeats, batches=batches, fast=fast)
    grid = f"{len(tokens)} sizes x {len(contexts)} contexts x {len(batches)} batches, {repeats} repeats"
    rows = list(tqdm(points, total=len(tokens) * len(contexts) * len(batches),
                     desc=f"profile {loaded.spec.label} ({grid})", unit="point", disable=not progress))
    profile = LatencyProfile(model=loaded.spec.label, device=device_name(device), dtype=str(loaded.model.dtype)[6:],
                             quantization=loaded.spec.quantization, weight_bytes=loaded.weight_bytes,
                             kv_bytes_per_token=loaded.kv_bytes_per_token, forward=rows[0].get("forward", "eager"),
                             rows=tuple((r["tokens"], r["context"], r["median_s"], r["batch"]) for r in rows),
                             noise=spread(rows))
    power = measure_power(device)
    return profile, {"power_watts": power["watts"], "power_source": power["source"], "repeats": repeats,
                     "threads": torch.get_num_threads(), "batches": list(batches)}


def record_reference(target: ModelLike, draft: ModelLike, prompts, dataset: str, max_chain: int = 8,
                     tree_budgets: Sequence[int] = (), max_new_tokens: int = 64,
                     sampling: Optional[SamplingParams] = None, tree: TreeShape = TreeShape(),
                     target_name: Optional[str] = None, draft_name: Optional[str] = None,
                     dtype: str = "float32", cross_tokenizer: str = "auto",
                     progress: bool | str = False, families: Optional[Sequence[str]] = None,
                     hybrid_budgets: Sequence[int] = (), hybrid_method: Optional[str] = None,
                     hybrid_suffix=None) -> AcceptanceReference:
    """Run the pair with a long chain (and trees at each budget) and keep per-step acceptance
    (counted in target tokens; a draft with another tokenizer also records its draft tokens per
    target token, which prices its drafting; `draft` "prompt-lookup" or "suffix": that method's own chains and
    trees, each step kept whatever it drafted (`steps_at_k`)).
    `progress`: a bar per run (the chain, each tree budget), labelled with the pair or the string given.
    Each step keeps its prompt's index, and `families` (one per prompt) its family, so the reference can be
    narrowed to one family (`AcceptanceReference.for_family`). `hybrid_budgets`: also run suffix decoding's hybrid
    with this draft model or head (`hybrid_method`; by default `suffix-tree-chain` for a model, `suffix-eagle-tree`
    for a head) at each suffix budget, with `hybrid_suffix`'s knobs (a `SuffixSettings` or a dict of its fields; its
    cache holds these prompts' outputs only), and keep which drafter took each step: what prices the hybrid."""
    from specbench.heads.profile import head_feature_bytes, head_label, is_head

    sampling = sampling or SamplingParams()
    target_loaded = as_loaded(target, dtype)
    lookup = draft in FREE_DRAFTS  # chains and trees copied from the context (and earlier outputs): no draft model
    suffix = None
    if lookup:
        draft_loaded, draft_label = None, draft
        chain_method, tree_method = (lookup_method("chain"), lookup_method("tree")) if draft == LOOKUP_DRAFT else (
            "suffix", "suffix-tree")
        if draft == SUFFIX_DRAFT:  # its cache of earlier outputs holds these prompts' only, as in a tune's runs
            from specbench.decode.suffix_drafter import SuffixSettings

            suffix = SuffixSettings(cache="drafter")
    elif is_head(draft):  # a draft head (a folder or an EagleHead): its own chains and trees
        draft_loaded, draft_label = draft, head_label(draft)
        chain_method, tree_method = "eagle", "eagle-tree"
    else:
        draft_loaded, draft_label = as_loaded(draft, dtype), None
        chain_method, tree_method = kind_method("chain"), kind_method("tree")
    draft_label = draft_name or draft_label
    pair = progress if isinstance(progress, str) else (
        f"reference {draft_label or draft_loaded.spec.label} -> {target_name or target_loaded.spec.label}")
    label = (lambda what: f"{pair}: {what}") if progress else (lambda what: False)  # noqa: E731
    chain = run(target_loaded, prompts, method=chain_method, draft=draft_loaded, k=max_chain,
                max_new_tokens=max_new_tokens, sampling=sampling, progress=label(f"chain K={max_chain}"),
                cross_tokenizer=cross_tokenizer, suffix=suffix)
    # End-of-budget steps draft fewer and would bias min(a, K). Prompt lookup keeps only its steps that
    # found a full chain: without a match it verifies one token whatever K is, so its planner's choice
    # of K matters only where a match is, and that is the acceptance the planner needs.
    full = chain[chain["drafted"] == max_chain]
    tree_accepts, tree_depth, tree_width, tree_prompts, tree_steps, tree_steps_prompts = {}, {}, {}, {}, {}, {}
    for budget in tree_budgets:
        records = run(target_loaded, prompts, method=tree_method, draft=draft_loaded, k=budget, tree=tree,
                      max_new_tokens=max_new_tokens, sampling=SamplingParams(
                          temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          rule="greedy" if sampling.greedy else "sample-match"),
                      progress=label(f"tree budget {budget}"),
                      cross_tokenizer="text" if cross_tokenizer == "shared-vocab" else cross_tokenizer, suffix=suffix)
        if lookup:  # every step, as found: most draft fewer nodes than the budget, or none
            tree_steps[budget] = tuple((int(d), int(a)) for d, a in zip(records["drafted"], records["accepted"]))
            tree_steps_prompts[budget] = tuple(int(p) for p in records["prompt_index"])
        steps = records[records["drafted"] == budget]
        if steps.empty:  # e.g. prompt lookup never found that many candidates: nothing measured at this budget
            continue
        tree_accepts[budget] = tuple(int(a) for a in steps["accepted"])
        tree_prompts[budget] = tuple(int(p) for p in steps["prompt_index"])
        tree_depth[budget] = float(steps["tree_depth"].mean())
        tree_width[budget] = min(tree.beam, budget)
    hybrid = _hybrid(target_loaded, draft_loaded, prompts, hybrid_budgets, hybrid_method, hybrid_suffix, tree,
                     max_new_tokens=max_new_tokens, sampling=sampling, label=label,
                     cross_tokenizer=cross_tokenizer) if hybrid_budgets else {}
    drafting = chain[chain["drafted"] > 0]
    cross = sorted(set(drafting["cross_tokenizer"]) - {""})
    draft_per_target = (float(drafting["draft_tokens"].sum() / drafting["drafted"].sum())
                        if cross and drafting["drafted"].sum() else 1.0)
    return AcceptanceReference(
        cross_tokenizer=",".join(cross), draft_per_target=draft_per_target,
        chain_hits=_hits(chain, max_chain, max_new_tokens, lookup),
        **_run_steps(chain, max_chain, lookup),
        draft=draft_label or acceptance_label(draft_loaded.spec.label),
        target=target_name or acceptance_label(target_loaded.spec.label),
        dataset=dataset, rule=sampling.effective_rule, temperature=sampling.temperature, max_chain=max_chain,
        chain_accepts=tuple(int(a) for a in full["accepted"]), tree_accepts=tree_accepts,
        tree_depth=tree_depth, tree_width=tree_width, chain_prompts=tuple(int(p) for p in full["prompt_index"]),
        tree_prompts=tree_prompts, tree_steps=tree_steps, tree_steps_prompts=tree_steps_prompts,
        prompt_families=tuple(str(f) for f in families) if families else (),
        feature_bytes=head_feature_bytes(draft) if chain_method == "eagle" else 0, **hybrid)


def _hybrid(target, draft, prompts, budgets: Sequence[int], method: Optional[str], suffix, tree: TreeShape,
            label, **options) -> dict:
    """The hybrid's steps at each budget (`AcceptanceReference.hybrid_steps`) and how it ran."""
    from dataclasses import asdict, replace

    from specbench.decode.suffix_drafter import as_settings
    from specbench.heads.profile import is_head
    from specbench.types import SpecbenchError

    if draft is None:
        raise SpecbenchError("a hybrid pairs suffix decoding with a draft model or head; prompt lookup and suffix "
                             "decoding have no hybrid of their own")
    method = method or ("suffix-eagle-tree" if is_head(draft) else "suffix-tree-chain")
    if method not in HYBRIDS:
        raise SpecbenchError(f"{method!r} is not one of suffix decoding's hybrids {sorted(HYBRIDS)}")
    if (method in HEAD_HYBRIDS) != is_head(draft):
        raise SpecbenchError(f"{method} drafts with a {'head' if method in HEAD_HYBRIDS else 'draft model'}; "
                             f"the draft given is {'a head' if is_head(draft) else 'a model'}")
    settings = replace(as_settings(suffix), cache="drafter", name="")
    steps, owners = {}, {}
    for budget in budgets:
        records = run(target, prompts, method=method, draft=draft, k=budget, tree=tree, suffix=settings,
                      progress=label(f"{method} budget {budget}"), **options)
        steps[budget] = tuple((int(s == "other"), int(d), int(a), int(h)) for s, d, a, h in zip(
            records["draft_source"], records["drafted"], records["accepted"], records["tree_depth"]))
        owners[budget] = tuple(int(p) for p in records["prompt_index"])
    kept = {key: value for key, value in asdict(settings).items() if key not in ("cache", "name")}
    return {"hybrid_method": method, "hybrid_steps": steps, "hybrid_prompts": owners, "hybrid_settings": kept,
            "hybrid_width": min(tree.beam, settings.other_k) if method in TREE_OTHERS else 1}


def _asked(chain, max_chain: int, max_new_tokens: int):
    """Prompt lookup's steps asked for a full chain: those whose output had room for one (the loop caps
    the last ones at what remains)."""
    done = reply_position(chain, keys=("prompt_index",))  # tokens before each step
    return chain[(chain["step_k"] == max_chain) & (max_new_tokens - done - 1 >= max_chain)]


def _hits(chain, max_chain: int, max_new_tokens: int, lookup: bool) -> dict:
    """Prompt lookup: the share of its steps asked for a full chain that found one (the rest verify the
    bonus alone, or a partial match); model drafts always draft, so nothing is kept."""
    if not lookup or "step_k" not in chain:
        return {}
    asked = _asked(chain, max_chain, max_new_tokens)
    return {max_chain: round(float((asked["drafted"] == max_chain).mean()), 4)} if len(asked) else {}


def _run_steps(chain, max_chain: int, lookup: bool) -> dict:
    """Prompt lookup, suffix decoding: (drafted, accepted) of every step of the run at `max_chain`, partial
    matches and each output's capped last steps included, with each step's prompt (model drafts keep their
    full steps only)."""
    pairs = tuple((int(d), int(a)) for d, a in zip(chain["drafted"], chain["accepted"])) if lookup else ()
    if not pairs:
        return {}
    prompts = tuple(int(p) for p in chain["prompt_index"])
    return {"steps_at_k": {max_chain: pairs}, "steps_prompts": {max_chain: prompts}}


def profile_worker(endpoint: str, tokens: Sequence[int] = DEFAULT_TOKENS, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                   repeats: int = 5, batches: Sequence[int] = (1,), **client_options) -> tuple[LatencyProfile, dict]:
    """The same grid measured by a worker on its own hardware (the `profile` op), for its loaded target."""
    from specbench.worker.client import RemoteTarget

    client_options.setdefault("timeout_s", 600.0)
    remote = RemoteTarget(endpoint, **client_options)
    reply = remote.profile(tokens=tokens, contexts=contexts, repeats=repeats, batches=batches)
    profile = LatencyProfile(model=reply["model"], device=reply.get("device_name") or reply["device"],
                             dtype=reply.get("dtype") or "float32", quantization=reply.get("quantization") or "none",
                             weight_bytes=reply.get("weight_bytes") or 0,
                             kv_bytes_per_token=reply.get("kv_bytes_per_token") or 0,
                             forward=(reply["rows"] or [{}])[0].get("forward", "eager"),
                             rows=tuple((r["tokens"], r["context"], r["median_s"], r.get("batch", 1))
                                        for r in reply["rows"]), noise=spread(reply["rows"]))
    return profile, {"repeats": repeats, "worker": endpoint, "batches": list(batches), "power_source": "configured", "power_watts": None}
