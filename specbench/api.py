"""The three-line notebook API: `run(target=..., draft=..., method=..., prompts=...) -> DataFrame`."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence, Union

import pandas as pd
import torch
from tqdm.auto import tqdm

from specbench.decode.drafters import ModelDrafter, PromptLookupDrafter
from specbench.decode.loop import generate
from specbench.decode.target import LocalTarget, Target
from specbench.decode.tree_drafters import TreeDrafter
from specbench.models.loading import LoadedModel, VocabMismatchError, check_vocab_compatible, load_model
from specbench.models.self_draft import truncated_view
from specbench.models.spec import ModelSpec
from specbench.types import SamplingParams, SpecbenchError

METHODS = ("target-only", "chain", "tree", "fixed-tree", "prompt-lookup", "prompt-lookup-tree", "self-draft",
           "substitute")
PLANNABLE_METHODS = ("chain", "prompt-lookup", "self-draft", "substitute")
WORKER_METHODS = ("server-only", "server-only-ar")  # run wholly on a remote worker (AutoDraft's baselines)
ModelLike = Union[str, ModelSpec, LoadedModel]


def as_loaded(model: ModelLike, dtype: str = "float32") -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    spec = model if isinstance(model, ModelSpec) else ModelSpec(model=model, dtype=dtype)
    return load_model(spec)


def encode_prompts(prompts: Sequence[Union[str, Sequence[int]]], tokenizer, chat: bool = True) -> list[list[int]]:
    """Strings become token ids (through the chat template when the tokenizer has one); ids pass."""
    encoded = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise SpecbenchError(f"prompt {index} is text but the target has no tokenizer; pass token ids")
            if chat and getattr(tokenizer, "chat_template", None):
                prompt = tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
        if not ids:
            raise SpecbenchError(f"prompt {index} is empty")
        encoded.append(ids)
    return encoded


@dataclass(frozen=True)
class TreeShape:
    """Tree drafting settings: `k` is the node budget; widths per depth make a fixed tree."""

    widths: tuple[int, ...] = (4, 2, 2, 1)
    max_depth: int = 6
    beam: int = 4
    branch: int = 4
    lookup_candidates: int = 4
    prune: bool = True  # dynamic trees: skip levels no node of which could be kept (same tree, fewer forwards)


def make_drafter(method: str, target: LocalTarget | Target, draft: Optional[ModelLike] = None,
                 target_model: Optional[LoadedModel] = None, self_draft_layers: Optional[int] = None,
                 substitute_quantization: str = "8bit", dtype: str = "float32", tree: TreeShape = TreeShape()):
    """The drafter a method needs; None for target-only."""
    if method not in METHODS + WORKER_METHODS:
        raise SpecbenchError(f"unknown method {method!r}; choose one of {METHODS + WORKER_METHODS}")
    if method in ("target-only",) + WORKER_METHODS:
        return None
    if method == "prompt-lookup":
        return PromptLookupDrafter()
    if method == "prompt-lookup-tree":
        return PromptLookupDrafter(max_candidates=tree.lookup_candidates, name=method)
    if method in ("chain", "tree", "fixed-tree"):
        if draft is None:
            raise SpecbenchError(f"method {method!r} needs a draft model: pass draft=...")
        loaded = as_loaded(draft, dtype)
        if target_model is not None:
            check_vocab_compatible(loaded, target_model)
        elif loaded.vocab_size < target.vocab_size and loaded.tokenizer is None:
            raise VocabMismatchError(
                f"draft has {loaded.vocab_size} output ids but the target has {target.vocab_size}")
        if method == "tree":
            return TreeDrafter(loaded, target.vocab_size, max_depth=tree.max_depth, beam=tree.beam,
                               branch=tree.branch, name=f"tree:{loaded.spec.label}", prune=tree.prune)
        if method == "fixed-tree":
            return TreeDrafter(loaded, target.vocab_size, widths=tree.widths, name=f"fixed-tree:{loaded.spec.label}")
        return ModelDrafter(loaded, target.vocab_size, name=f"chain:{loaded.spec.label}")
    if target_model is None:
        raise SpecbenchError(f"method {method!r} drafts from the target's own weights, so it needs a local target model")
    if method == "self-draft":
        layers = self_draft_layers or max(1, target_model.model.config.num_hidden_layers // 4)
        return ModelDrafter(truncated_view(target_model, layers), target.vocab_size, name=f"self-draft:{layers}")
    spec = target_model.spec.with_(quantization=substitute_quantization)
    return ModelDrafter(load_model(spec), target.vocab_size, name=f"substitute:{spec.label}")


def run(target: Union[ModelLike, Target], prompts: Sequence[Union[str, Sequence[int]]],
        method: Union[str, Iterable[str]] = "chain", draft: Optional[ModelLike] = None, k: int = 4,
        max_new_tokens: int = 64, sampling: Optional[SamplingParams] = None, seed: int = 0,
        self_draft_layers: Optional[int] = None, substitute_quantization: str = "8bit",
        dtype: str = "float32", chat: bool = True, warmup: bool = True, progress: bool = True,
        tokenizer=None, tree: TreeShape = TreeShape(), proactive: bool = False, planner=None) -> pd.DataFrame:
    """Run each method over each prompt and return one row per speculative step.

    For tree methods `k` is the node budget. Every method shares the target and the loop, so
    tokens are counted identically; a short
    warm-up generation per method is run first and discarded. Output token ids per (method,
    prompt) come back through `outputs(df)`. `proactive` drafts ahead while a remote verify is in
    flight (chain methods on a RemoteTarget). A `planner` (`specbench.plan.step_planner.StepPlanner`)
    picks the chain length per step up to `k` (AutoDraft's per-step choice); it starts each prompt
    from its reference prior, and those runs are recorded as method "<method>+planner".
    """
    sampling = sampling or SamplingParams()
    methods = [method] if isinstance(method, str) else list(method)
    for name in methods:
        if name not in METHODS + WORKER_METHODS:
            raise SpecbenchError(f"unknown method {name!r}; choose one of {METHODS + WORKER_METHODS}")
        if name in WORKER_METHODS and not hasattr(target, "generate_on_worker"):
            raise SpecbenchError(f"method {name!r} runs on a worker: pass target=RemoteTarget(...)")
        if planner is not None and name not in PLANNABLE_METHODS + ("target-only",) + WORKER_METHODS:
            raise SpecbenchError(f"a step planner chooses chain lengths; method {name!r} is not a chain method "
                                 f"(plannable: {PLANNABLE_METHODS})")
    target_model = None
    if isinstance(target, (str, ModelSpec, LoadedModel)):
        target_model = as_loaded(target, dtype)
        target = LocalTarget(target_model)
    tokenizer = tokenizer or (target_model.tokenizer if target_model else None)
    eos = target_model.eos_token_ids if target_model else tuple(getattr(target, "eos_token_ids", ()))
    prompt_ids = encode_prompts(prompts, tokenizer, chat)
    rows = []
    bar = tqdm(total=len(methods) * len(prompt_ids), desc="specbench run", disable=not progress)
    for name in methods:
        drafter = make_drafter(name, target, draft, target_model, self_draft_layers, substitute_quantization, dtype,
                               tree)
        planned = planner if name in PLANNABLE_METHODS else None  # baselines run as they are
        one = dict(target=target, method=name, drafter=drafter, k=k, sampling=sampling, eos=eos, draft=draft,
                   proactive=proactive, planner=planned)
        if warmup:
            _generate_one(prompt_ids[0], min(8, max_new_tokens), 0, seed, **one)
        for index, ids in enumerate(prompt_ids):
            if planned is not None:
                planned.reset()
            result = _generate_one(ids, max_new_tokens, index, seed * 1_000_003 + index, **one)
            for record in result.records:
                rows.append({**asdict(record), "k": 0 if name in ("target-only", "server-only-ar") else k,
                             "prompt_tokens": len(ids), "prefill_s": result.prefill_s})
            bar.update()
    bar.close()
    return pd.DataFrame(rows)


def _generate_one(ids, max_new_tokens, prompt_index, seed, *, target, method, drafter, k, sampling, eos, draft,
                  proactive, planner):
    """One prompt through one method; worker methods run wholly on the worker."""
    if method in WORKER_METHODS:
        draft_spec = ModelSpec(draft) if isinstance(draft, str) else draft if isinstance(draft, ModelSpec) else None
        return target.generate_on_worker(method, ids, k=k, max_new_tokens=max_new_tokens, sampling=sampling,
                                         seed=seed, prompt_index=prompt_index, draft=draft_spec)
    return generate(target, drafter, ids, k=k, max_new_tokens=max_new_tokens, sampling=sampling,
                    generator=torch.Generator().manual_seed(seed), eos_token_ids=eos,
                    method=f"{method}+planner" if planner is not None else method,
                    prompt_index=prompt_index, proactive=proactive, planner=planner)


def outputs(records: pd.DataFrame) -> dict[tuple[str, int], list[int]]:
    """Generated token ids per (method, prompt_index), rebuilt from the step records."""
    result: dict[tuple[str, int], list[int]] = {}
    for (method, prompt), group in records.groupby(["method", "prompt_index"], sort=False):
        result[(method, prompt)] = [t for tokens in group.sort_values("step")["accepted_tokens"] for t in tokens]
    return result
