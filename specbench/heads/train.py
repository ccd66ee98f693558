"""`specbench train-draft`: train a head for a target on a prompt set, in the layout heads are read in.

Why these choices, on a 2-core CPU for a 135M target within minutes:
- Data: the target's own greedy responses to the prompts (what it will be asked to continue), made in
  batches by Hugging Face's `generate` (not speculative: data only), or text as it is (`teacher_forced`:
  ShareGPT's exchanges, a user turn's end and the assistant's reply, as EAGLE trained; any other prompt
  set's prompts). One target forward per sequence gives every position's features and the target's
  own next-token distribution: the head learns the target's choices, not the text's.
- Labels: the target's top `soft_top` probabilities per position (`labels="soft"`, EAGLE-3's distillation
  of the distribution, more signal per token than its argmax alone), or its argmax (`"greedy"`).
- Draft vocabulary: the ids the target chose most often in the training data (EAGLE-3's reduced
  vocabulary); the head's output layer and final norm start as the target's own rows for those ids,
  so it starts as "the target's head over a fused, one-layer guess of its last hidden state".
- Feature loss (`feature_loss`, EAGLE-1's regression, off by default): the head's normed state is also pulled
  towards the target's own final normed hidden state at the position it predicts (a smooth L1 per dimension):
  hundreds of numbers per position where the labels give one distribution, for data too small to generalise from.
- Training-time test (EAGLE-3): each sequence is unrolled `ttt_steps` times: step j reads at base
  position p the head's own output of step j - 1 as its feature, attending to the real positions up to
  p and to its own earlier steps at p, which is exactly what drafting j tokens past p sees.
- Resumable: the data and the target's features and labels are cached, and a checkpoint (the head in its layout, the
  optimizer, the step) is written every `checkpoint_every` steps; a rerun continues from it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from specbench.heads.data import load_cached, save_cached
from specbench.heads.model import EagleHead
from specbench.types import SpecbenchError


INITS = ("output", "layer")


@dataclass(frozen=True)
class TrainSpec:
    target: str
    prompts: str | tuple = "sharegpt"  # a dataset name, a JSONL path, or the prompts (texts or token ids)
    prompt_count: int = 256
    held_out: int = 8  # prompts kept out of training for the acceptance shown while training
    max_new_tokens: int = 96  # of each target response
    max_length: int = 384  # tokens per training sequence (prompt + response), cut beyond
    samples: int = 1  # responses per prompt: the greedy one, then sampled ones at `temperature`
    temperature: float = 1.0
    teacher_forced: bool = False  # train on text as it is (ShareGPT: its exchanges), no responses generated
    repeat_spans: float = 0.0  # share of sequences given one of their own spans again at the end (`data.with_repeats`)
    loss_on: str = "all"  # all: predict at every position; reply: only after the prompt, where drafting will
    labels: str = "soft"  # soft: the target's top-`soft_top` distribution; greedy: its argmax
    soft_top: int = 16
    feature_loss: float = 0.0  # weight of the regression on the target's final state (EAGLE-1); 0: none
    own_embeddings: bool = False  # write a copy of the target's embeddings with the head (to draft on a worker's client)
    draft_vocab: int = 8192
    layers: Optional[tuple] = None  # the target layers whose inputs the head fuses (default: EAGLE-3's 2, L/2, L-3)
    ttt_steps: int = 3
    epochs: float = 2.0
    learning_rate: float = 1e-3
    batch: int = 4  # sequences per optimizer step
    minutes: Optional[float] = None  # stop training when this much time has passed (checkpoint kept)
    checkpoint_every: int = 25
    eval_every: int = 50
    layout: str = "eagle3"
    dtype: str = "float32"
    kernels: str = "default"  # the target's CPU linear kernels (tuned: its replies and feature passes run faster)
    init: str = "output"  # output: the target's output rows and final norm; layer: also its layer at the high feature
    seed: int = 0

    def check(self) -> None:
        if self.prompt_count < self.held_out + 2:
            raise SpecbenchError(f"prompt_count {self.prompt_count} leaves nothing to train on after {self.held_out} "
                                 f"held-out prompts")
        if self.layers is not None and (len(self.layers) < 1 or min(self.layers) < 0):
            raise SpecbenchError(f"layers names the target layers whose inputs the head reads, e.g. (2, 15, 27); got "
                                 f"{self.layers}")
        if self.samples < 1 or not 0 < self.temperature < float("inf"):
            raise SpecbenchError(f"samples must be at least 1 and temperature positive, got {self.samples} and "
                                 f"{self.temperature}")
        if self.ttt_steps < 1 or self.draft_vocab < 2 or self.batch < 1 or self.epochs <= 0 or self.soft_top < 1:
            raise SpecbenchError("ttt_steps, batch, epochs and soft_top must be positive and draft_vocab at least 2")
        if not 0 <= self.repeat_spans <= 1:
            raise SpecbenchError(f"repeat_spans is a share of the sequences, 0 to 1, got {self.repeat_spans}")
        if not 0 <= self.feature_loss < float("inf"):
            raise SpecbenchError(f"feature_loss is a weight, 0 or more, got {self.feature_loss}")
        if not 0 < self.learning_rate < float("inf"):
            raise SpecbenchError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.minutes is not None and not self.minutes > 0:
            raise SpecbenchError(f"minutes must be positive (or None: no time bound), got {self.minutes}")
        if self.max_new_tokens < 1 or self.max_length < self.ttt_steps + 2 or (
                not self.teacher_forced and self.max_length <= self.max_new_tokens):
            raise SpecbenchError(f"max_length {self.max_length} must hold a prompt and a {self.max_new_tokens}-token "
                                 f"response (more than max_new_tokens) and a {self.ttt_steps}-step unroll "
                                 f"(at least ttt_steps + 2); max_new_tokens at least 1")
        if self.init not in INITS:
            raise SpecbenchError(f"init is one of {INITS}, got {self.init!r}")
        if self.loss_on not in ("reply", "all"):
            raise SpecbenchError(f"loss_on is 'reply' or 'all', got {self.loss_on!r}")
        if self.labels not in ("soft", "greedy"):
            raise SpecbenchError(f"labels is 'soft' or 'greedy', got {self.labels!r}")


def soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> Optional[torch.Tensor]:
    """Cross-entropy of draft-vocabulary `logits` [n, draft vocab] against the target's top probabilities
    (`ids` [n, top] as draft ids, -100 outside the draft vocabulary), renormalized over the ids the head
    can draft; rows with none are left out (None when every row is)."""
    valid = ids >= 0
    rows = valid.any(-1)
    if not rows.any():
        return None
    weights = probs.float() * valid
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.clamp_min(0).long())
    return -(weights * log_q).sum(-1)[rows].mean()


def draft_ids(labels: list[torch.Tensor], size: int) -> list[int]:
    """The `size` ids the target chose most often (ascending, as d2t wants)."""
    counts = torch.bincount(torch.cat(labels).long())
    size = min(size, int((counts > 0).sum()))
    return sorted(counts.topk(size).indices.tolist())


def unrolled_logits(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, steps: int,
                    start: int = 0, states: Optional[list] = None) -> list[torch.Tensor]:
    """Draft-vocabulary logits per training-time-test step: step j [n - j - start, draft vocab] at base
    positions p = start .. n - 1 - j, each predicting the token after x_{p + 1 + j}.

    `ids` are x_0 .. x_n, `features` the fused target features of positions 0 .. n - 1. Step 0 is the
    head over the real features; step j reads token x_{p + 1 + j} with step j - 1's output at p as its
    feature, at position p + j, attending to the real positions 0 .. p and to steps 1 .. j at base p.
    Positions before `start` (a prompt, whose continuation drafting never proposes) serve only as keys:
    nothing is predicted there, which saves most of the work when prompts are long. `states`, when given, gets
    each step's normed state (what its logits are read from), row for row."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer = head.layers[0]
    attention = layer.self_attn
    n, group = features.shape[0], attention.heads // attention.kv_heads
    start = max(0, min(start, n - 1))
    base = torch.arange(n)
    causal = base[None, :] <= base[:, None]  # query p sees real key q <= p
    scale = 1 / math.sqrt(attention.dim)
    keys, values, out = [], [], []
    feature = features
    for step in range(steps):
        count = n - step - start  # base positions that still have a token to read and a label
        if count <= 0:
            break
        low = start if step else 0  # step 0 runs over every real position: they are all keys
        rows = n - step - low
        tokens = ids[1 + step + low:1 + step + low + rows]
        current = feature[:rows]
        if layer.norm_before_residual:
            current = layer.hidden_norm(current)
            residual = current
        else:
            residual, current = current, layer.hidden_norm(current)
        x = torch.cat([layer.input_layernorm(head.embed_tokens(tokens).to(current.dtype)), current], dim=-1)
        q = attention.q_proj(x).view(rows, attention.heads, attention.dim).transpose(0, 1)
        k = attention.k_proj(x).view(rows, attention.kv_heads, attention.dim).transpose(0, 1)
        v = attention.v_proj(x).view(rows, attention.kv_heads, attention.dim).transpose(0, 1)
        cos, sin = head.rotary(x[None], (base[low:low + rows] + step)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        q, k = q[0][:, start - low:], k[0]  # queries only where something is predicted
        residual = residual[start - low:]
        keys.append(k.repeat_interleave(group, dim=0))
        values.append(v.repeat_interleave(group, dim=0))
        real = (q @ keys[0].transpose(1, 2)) * scale  # [heads, count, n]
        real = real.masked_fill(~causal[start:start + count, :n], float("-inf"))
        own = [(q * keys[i][:, :count]).sum(-1, keepdim=True) * scale for i in range(1, step + 1)]  # [heads, count, 1]
        weights = torch.softmax(torch.cat([real, *own], dim=-1), dim=-1)
        mixed = weights[..., :n] @ values[0]
        for i in range(1, step + 1):
            mixed = mixed + weights[..., n + i - 1:n + i] * values[i][:, :count]
        hidden = residual + attention.o_proj(mixed.transpose(0, 1).reshape(count, attention.heads * attention.dim))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        normed = head.norm(hidden)
        out.append(head.lm_head(normed))
        if states is not None:
            states.append(normed)
        feature = hidden
    return out


def _initial_head(target, vocabulary: list[int], seed: int, layer_ids, init: str = "output") -> EagleHead:
    from specbench.heads.build import new_head

    head = new_head(target, draft_ids=vocabulary, layer_ids=layer_ids, seed=seed)
    with torch.no_grad():  # start from the target's own output rows and final norm
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[vocabulary])
        final_norm = getattr(target.model.model, "norm", None)
        if final_norm is not None and final_norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(final_norm.weight)
        if init == "layer":
            _copy_target_layer(head, target, layer_ids)
    return head


def _copy_target_layer(head: EagleHead, target, layer_ids) -> None:
    """Start the head's layer as the target's layer that reads the high feature: `fc` passes that feature through
    and the layer's feature half of q/k/v, its output projection, MLP and norms are the target layer's, the token
    half zero. At step 0 the head then computes what the target computed at that layer (a logit-lens guess of the
    next token from a pretrained transformation), and training teaches it the shift to the token after: a prior
    for the few tokens a CPU can train on, where a random layer must learn the target's residual stream anew."""
    from specbench.heads.features import decoder_layers

    high, hidden = max(layer_ids), head.config.hidden_size
    layers = decoder_layers(target.model)
    if high >= len(layers):
        raise SpecbenchError(f"init 'layer' copies the target layer that reads the high feature, and layer {high} is "
                             f"the final hidden state (no layer reads it): use init 'output' or a lower --layers")
    source, layer = layers[high], head.layers[0]
    attention = source.self_attn
    pairs = [(layer.self_attn.o_proj, attention.o_proj), (layer.mlp.gate_proj, source.mlp.gate_proj),
             (layer.mlp.up_proj, source.mlp.up_proj), (layer.mlp.down_proj, source.mlp.down_proj)]
    shapes = [(mine.weight.shape, theirs.weight.shape) for mine, theirs in pairs]
    shapes += [((p.out_features, p.in_features // 2), getattr(attention, name).weight.shape)
               for name, p in (("q_proj", layer.self_attn.q_proj), ("k_proj", layer.self_attn.k_proj),
                               ("v_proj", layer.self_attn.v_proj))]
    if head.config.features_size != hidden or any(mine != theirs for mine, theirs in shapes):
        raise SpecbenchError(f"init 'layer' needs the head sized as target layer {high} (weights {shapes}); use "
                             f"init 'output'")
    for mine, theirs in pairs:
        mine.weight.copy_(theirs.weight)
    for name in ("q_proj", "k_proj", "v_proj"):  # [token half | feature half]; target biases, if any, are left out
        mine = getattr(layer.self_attn, name).weight
        mine[:, :hidden].zero_()
        mine[:, hidden:].copy_(getattr(attention, name).weight)
    layer.hidden_norm.weight.copy_(source.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
    block = list(layer_ids).index(high)  # raw features sit side by side in layer_ids order (FeatureTap.joined)
    head.fc.weight.zero_()
    head.fc.weight[:, block * hidden:(block + 1) * hidden].copy_(torch.eye(hidden))
    if head.fc.bias is not None:
        head.fc.bias.zero_()


@dataclass
class TrainResult:
    head: EagleHead  # or the distilled draft model (`distil.py`)
    folder: Path
    history: pd.DataFrame  # per logged step: loss per TTT step, held-out tokens per step
    seconds: dict
    data: dict  # sequences, tokens, draft vocabulary


def optimization(trainable: list, spec: TrainSpec, total_steps: int, state: Optional[dict]):
    """(AdamW, its warm-up-then-cosine schedule, the step reached, the history so far), from `state` on a
    resume: what a head's training and a distillation share."""
    optimizer = torch.optim.AdamW(trainable, lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(
        0.05, 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))))
    if state is None:
        return optimizer, schedule, 0, []
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return optimizer, schedule, state["step"], state["history"]


def train_head(spec: TrainSpec, folder: str | Path, progress: bool = True) -> TrainResult:
    """Train a head for `spec.target`; resumes from `folder`'s checkpoint. The head is written to
    `folder/head` in `spec.layout` (what `run(method="eagle", draft=...)` reads)."""
    from specbench.heads.config import check_layer_ids, default_layer_ids
    from specbench.heads.data import prepare
    from specbench.heads.layouts import load_head

    spec.check()
    def layer_ids_of(count: int) -> tuple:
        if spec.layers:
            check_layer_ids(spec.layers, count, "train-draft --layers")
        return tuple(spec.layers) if spec.layers else default_layer_ids(count)

    prepared = prepare(spec, folder, layer_ids_of, progress)
    target, data, passes, held, seconds, started = (prepared.target, prepared.data, prepared.passes, prepared.held,
                                                    prepared.seconds, prepared.started)
    folder, data_path = prepared.folder, prepared.folder / "data.pt"
    vocabulary = data.get("vocabulary") or draft_ids([p[1][:, 0] for p in passes], spec.draft_vocab)
    if "vocabulary" not in data:
        data["vocabulary"] = vocabulary
        save_cached(data, data_path)
    checkpoint = folder / "checkpoint.pt"
    head_folder = folder / "head"
    if checkpoint.exists() and (head_folder / "config.json").exists():
        head = load_head(head_folder, target)
        state = load_cached(checkpoint, "delete it and head/ to train from the start (data and features are kept)")
    else:
        layer_ids = layer_ids_of(target.model.config.num_hidden_layers)
        head, state = _initial_head(target, vocabulary, spec.seed, layer_ids, spec.init), None
    head.train()
    trainable = [p for name, p in head.named_parameters() if not name.startswith("embed_tokens")]
    for parameter in trainable:  # fp32 master weights: a bf16 weight drops any update under 1/256 of itself
        parameter.data = parameter.data.float()
    # a bf16 target: the head's matmuls in bf16 too (about 2x faster on a CPU with AVX-512 bf16), its weights fp32
    mixed = torch.autocast("cpu", dtype=torch.bfloat16, enabled=target.model.dtype == torch.bfloat16)
    total_steps = max(1, int(spec.epochs * len(passes) / spec.batch))
    optimizer, schedule, step, history = optimization(trainable, spec, total_steps, state)
    to_draft = torch.full((target.vocab_size,), -100, dtype=torch.long)
    to_draft[torch.tensor(vocabulary)] = torch.arange(len(vocabulary))
    order = torch.randperm(len(passes), generator=torch.Generator().manual_seed(spec.seed + 1))
    deadline = started + 60 * spec.minutes if spec.minutes else None
    bar = tqdm(total=total_steps, initial=step, desc="train-draft: head", unit="step", disable=not progress)
    last_acceptance = history[-1].get("held_out_tokens_per_step") if history else None
    while step < total_steps and not (deadline and time.monotonic() > deadline):
        optimizer.zero_grad()
        losses = torch.zeros(spec.ttt_steps)
        for slot in range(spec.batch):
            index = int(order[(step * spec.batch + slot) % len(passes)])
            (raw, choices, probs), ids = passes[index][:3], torch.tensor(data["sequences"][index])
            # the first draft after a prompt of P tokens reads position P - 1's features and the target's token P
            start = max(0, prepared.prompt_lengths[index] - 1) if spec.loss_on == "reply" else 0
            states = [] if spec.feature_loss else None
            with mixed:
                features = head.fuse(raw[:-1].float())
                unrolled = unrolled_logits(head, ids, features, spec.ttt_steps, start, states)
            total = torch.zeros(())
            for j, logits in enumerate(unrolled):
                span = slice(len(ids) - logits.shape[0], len(ids))  # every step's last row predicts past x_n
                wanted = to_draft[choices[span].long()]
                if spec.labels == "soft":
                    loss = soft_cross_entropy(logits, wanted, probs[span])
                else:
                    loss = (nn.functional.cross_entropy(logits, wanted[:, 0], ignore_index=-100)
                            if (wanted[:, 0] >= 0).any() else None)
                if states is not None:  # the target's final state where this row's label came from
                    regression = nn.functional.smooth_l1_loss(states[j].float(), passes[index][3][span].float())
                    loss = spec.feature_loss * regression + (0 if loss is None else loss)
                if loss is not None:
                    total = total + loss * (0.8 ** j) / spec.batch  # later steps weigh less (EAGLE-3's decay)
                    losses[j] += float(loss.detach()) / spec.batch
            if total.requires_grad:
                total.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        record = {"step": step, **{f"loss_{j}": round(float(v), 4) for j, v in enumerate(losses)}}
        if step % spec.eval_every == 0 or step == total_steps:
            last_acceptance = held_out_acceptance(head, target, held, spec)
            record["held_out_tokens_per_step"] = last_acceptance
        history.append(record)
        bar.set_postfix_str(f"loss {float(losses[0]):.3f}" + (f", {last_acceptance:.2f} tok/step held out"
                                                              if last_acceptance else ""))
        bar.update()
        if step % spec.checkpoint_every == 0:
            _checkpoint(head, head_folder, checkpoint, optimizer, schedule, step, history, spec)
    bar.close()
    if not (checkpoint.exists() and step % spec.checkpoint_every == 0):  # the last step's, unless just written
        _checkpoint(head, head_folder, checkpoint, optimizer, schedule, step, history, spec)
    seconds["training"] = round(time.monotonic() - started - sum(seconds.values()), 1)
    head.eval()
    tokens = sum(len(s) for s in data["sequences"])
    return TrainResult(head, folder, pd.DataFrame(history), seconds,
                       {"sequences": len(data["sequences"]), "tokens": tokens, "draft_vocab": len(vocabulary),
                        "steps": step, "total_steps": total_steps})


def _checkpoint(head, head_folder, checkpoint, optimizer, schedule, step, history, spec) -> None:
    from specbench.heads.layouts import save_head

    save_head(head, head_folder, layout=spec.layout, target_name=spec.target, embeddings=spec.own_embeddings)
    save_cached({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": step,
                 "history": history}, checkpoint)


def held_out_acceptance(head: EagleHead, target, prompts: list, spec: TrainSpec, k: int = 4,
                        max_new_tokens: int = 32) -> float:
    """Tokens per step of greedy chains of `k` from the head on the held-out prompts (a real SD run)."""
    from specbench.api import run
    from specbench.decode.metrics import tokens_per_step
    from specbench.decode.target import LocalTarget

    was_training = head.training
    head.eval()
    records = run(LocalTarget(target), prompts, method="eagle", draft=head, k=k, max_new_tokens=max_new_tokens,
                  progress=False, warmup=False)
    head.train(was_training)
    return round(tokens_per_step(records), 3)
