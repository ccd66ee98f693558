"""`specbench train-draft --distil N`: a small draft model distilled from the target (SpecDecode's
distillation), for the same comparison as a head.

Why this shape: a target with no smaller sibling (SmolLM2-135M) still has a draft to distil, its own
first N layers with its final norm and output layer, copied and trained so that its next-token
distribution matches the target's (the target's top-16 probabilities renormalized, as heads learn).
The embeddings and output layer stay frozen (tied in most small models). The result is an ordinary
model folder (`<out>/draft`): it drafts chains and trees, here, through a worker and on it, like any
draft model, and is profiled and recorded like one.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from specbench.heads.data import load_cached, prepare, save_cached
from specbench.heads.train import TrainResult, TrainSpec, optimization
from specbench.types import SpecbenchError

# TrainSpec fields
HEAD_ONLY = ("draft_vocab", "layers", "ttt_steps", "layout", "init", "own_embeddings", "feature_loss")


def check_distil(spec: TrainSpec) -> None:
    """Refuse the head's options in a distillation: silently ignoring `--ttt-steps 5` would let a user
    believe a draft model was trained with it."""
    default = TrainSpec(target=spec.target)
    given = [name for name in HEAD_ONLY if getattr(spec, name) != getattr(default, name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        one = len(given) == 1
        raise SpecbenchError(f"{flags} shape{'s' if one else ''} a draft head; --distil trains a draft model of the "
                             f"target's first layers and has no use for {'it' if one else 'them'} (drop {flags}, or "
                             f"train a head without --distil)")


def distil_draft(spec: TrainSpec, layers: int, folder: str | Path, progress: bool = True) -> TrainResult:
    """Distil the target's first `layers` layers into a draft model; resumes from `folder`'s checkpoint.
    The draft is written to `folder/draft` (what `run(method="chain", draft=...)` reads)."""
    from transformers import AutoModelForCausalLM

    from specbench.models.loaded import LoadedModel
    from specbench.models.self_draft import truncated_view

    spec.check()
    check_distil(spec)
    prepared = prepare(spec, folder, lambda count: (), progress)  # no head: no features kept
    target, data, passes, seconds, started = (prepared.target, prepared.data, prepared.passes, prepared.seconds,
                                              prepared.started)
    folder = prepared.folder
    draft_folder, checkpoint = folder / "draft", folder / "draft-checkpoint.pt"
    if checkpoint.exists() and (draft_folder / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(draft_folder, dtype=target.model.dtype)
        if model.config.num_hidden_layers != layers:
            raise SpecbenchError(f"{draft_folder} holds a draft of {model.config.num_hidden_layers} layers, not "
                                 f"{layers}: resume with the same --distil, or train into a new folder")
        state = load_cached(checkpoint, "delete it and draft/ to train from the start (data and features are "
                                        "kept)")
    else:  # its own copy: training must not move the target's weights
        model, state = copy.deepcopy(truncated_view(target, layers).model), None
    model.train()
    frozen = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    trainable = [p for p in model.parameters() if id(p) not in frozen]
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) not in frozen)
    total_steps = max(1, int(spec.epochs * len(passes) / spec.batch))
    optimizer, schedule, step, history = optimization(trainable, spec, total_steps, state)
    order = torch.randperm(len(passes), generator=torch.Generator().manual_seed(spec.seed + 1))
    deadline = started + 60 * spec.minutes if spec.minutes else None
    loaded = LoadedModel(spec=target.spec.with_(model=str(draft_folder)), model=model, tokenizer=target.tokenizer)
    bar = tqdm(total=total_steps, initial=step, desc=f"train-draft: distil {layers} layers", unit="step",
               disable=not progress)
    last_acceptance = history[-1].get("held_out_tokens_per_step") if history else None
    while step < total_steps and not (deadline and time.monotonic() > deadline):
        optimizer.zero_grad()
        loss_sum = 0.0
        for slot in range(spec.batch):
            index = int(order[(step * spec.batch + slot) % len(passes)])
            (_, choices, probs), ids = passes[index][:3], torch.tensor(data["sequences"][index])
            start = max(0, prepared.prompt_lengths[index] - 1) if spec.loss_on == "reply" else 0
            logits = model(input_ids=ids[None]).logits[0, start:]
            loss = _distil_loss(logits, choices[start:], probs[start:], spec.labels)
            (loss / spec.batch).backward()
            loss_sum += float(loss.detach()) / spec.batch
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        record = {"step": step, "loss_0": round(loss_sum, 4)}
        if step % spec.eval_every == 0 or step == total_steps:
            last_acceptance = _held_out(loaded, target, prepared.held)
            record["held_out_tokens_per_step"] = last_acceptance
        history.append(record)
        bar.set_postfix_str(f"loss {loss_sum:.3f}" + (f", {last_acceptance:.2f} tok/step held out"
                                                      if last_acceptance else ""))
        bar.update()
        if step % spec.checkpoint_every == 0:
            _checkpoint(model, target, draft_folder, checkpoint, optimizer, schedule, step, history)
    bar.close()
    if not (checkpoint.exists() and step % spec.checkpoint_every == 0):
        _checkpoint(model, target, draft_folder, checkpoint, optimizer, schedule, step, history)
    seconds["training"] = round(time.monotonic() - started - sum(seconds.values()), 1)
    model.eval()
    tokens = sum(len(s) for s in data["sequences"])
    return TrainResult(model, folder, pd.DataFrame(history), seconds,
                       {"sequences": len(data["sequences"]), "tokens": tokens, "layers": layers, "steps": step,
                        "total_steps": total_steps})


def _distil_loss(logits: torch.Tensor, choices: torch.Tensor, probs: torch.Tensor, labels: str) -> torch.Tensor:
    """Cross-entropy against the target's top probabilities renormalized (soft) or its argmax (greedy: the
    first of the top ids, which `topk` sorts)."""
    if labels == "greedy":
        return torch.nn.functional.cross_entropy(logits.float(), choices[:, 0].long())
    weights = probs.float() / probs.float().sum(-1, keepdim=True)
    return -(weights * torch.log_softmax(logits.float(), -1).gather(-1, choices.long())).sum(-1).mean()


def _checkpoint(model, target, draft_folder, checkpoint, optimizer, schedule, step, history) -> None:
    model.save_pretrained(draft_folder)
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(draft_folder)
    save_cached({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": step,
                 "history": history}, checkpoint)


def _held_out(draft, target, prompts: list, k: int = 4, max_new_tokens: int = 32) -> float:
    """Tokens per step of greedy chains of `k` from the draft on the held-out prompts (a real SD run)."""
    from specbench.api import run
    from specbench.decode.metrics import tokens_per_step
    from specbench.decode.target import LocalTarget

    was_training = draft.model.training
    draft.model.eval()
    records = run(LocalTarget(target), prompts, method="chain", draft=draft, k=k, max_new_tokens=max_new_tokens,
                  progress=False, warmup=False)
    draft.model.train(was_training)
    return round(tokens_per_step(records), 3)
