"""Training data for a draft head or a distilled draft: sequences, and one target pass over each.

The sequences are the target's own greedy responses to the prompts, or text as it is
(`teacher_forced`; ShareGPT: its exchanges). One target forward per sequence gives what both trainings
read: the inputs of the head's layers per position and the target's top next-token probabilities.
All of it is cached in the training folder, so a resume does not pay for it again.
"""
from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from specbench.files import replacing
from specbench.heads.config import default_layer_ids
from specbench.types import SpecbenchError, reason


def save_cached(value, path: Path) -> None:
    """`torch.save`, whole or absent: a kill mid-write (minutes of target passes) leaves the last file."""
    with replacing(path) as temporary:
        torch.save(value, temporary)


def load_cached(path: Path, remedy: str):
    """What `save_cached` wrote to `path`; a file that does not load (damaged, or not written here) is
    refused naming it and `remedy`, not with the unpickler's own words."""
    try:
        return torch.load(path, weights_only=False)
    except Exception as error:  # torch raises RuntimeError, EOFError, OSError, UnpicklingError... for one cause
        raise SpecbenchError(f"{path} does not load ({reason(error)}): {remedy}") from None


def sequences(target, spec, prompts: list, progress: bool) -> list[list[int]]:
    """Token ids of each training sequence: the prompt (chat template applied) and the target's greedy
    response, then `spec.samples - 1` more responses sampled at `spec.temperature` (more of the target's
    own text per prompt: the contexts drafting meets off the greedy path), or the prompt alone when
    `teacher_forced`."""
    from specbench.api import encode_prompts

    if spec.teacher_forced:
        if _exchanges(prompts):
            return [exchange(target.tokenizer, messages, spec.max_length)[0] for messages in prompts]
        return [ids[-spec.max_length:] for ids in encode_prompts(prompts, target.tokenizer)]
    encoded = [ids[-_prompt_room(spec):] for ids in encode_prompts(prompts, target.tokenizer)]
    model, pad = target.model, (target.eos_token_ids or (0,))[0]
    out, batch, samples = [], 16, spec.samples
    bar = tqdm(total=len(encoded) * samples, desc="train-draft: target responses", unit="response",
               disable=not progress)
    for sample, start in ((s, b) for s in range(samples) for b in range(0, len(encoded), batch)):
        group = encoded[start:start + batch]
        width = max(len(ids) for ids in group)
        ids = torch.tensor([[pad] * (width - len(g)) + g for g in group])
        mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
        sampling = {"do_sample": False} if sample == 0 else {
            "do_sample": True, "temperature": spec.temperature, "top_p": 1.0, "top_k": 0}
        torch.manual_seed(spec.seed + 1000 * sample + start)
        with torch.inference_mode():
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=spec.max_new_tokens,
                                       pad_token_id=pad, **sampling)
        for row, prompt in zip(generated[:, width:].tolist(), group):
            response = row
            for index, token in enumerate(row):
                if token in target.eos_token_ids:
                    response = row[:index + 1]
                    break
            out.append((prompt + response)[:spec.max_length])
        bar.update(len(group))
    bar.close()
    return out


REPEAT_SPAN = (24, 64)  # tokens of a repeated span: a sentence or two, as a reply restates or quotes its prompt


def with_repeats(sequences: list, prompt_lengths: list, share: float, max_length: int, eos_ids, seed: int) -> list:
    """`share` of `sequences`, each with one of its own spans (`REPEAT_SPAN` tokens, from its reply or its prompt,
    half and half) appended again after its end (a closing end-of-sequence token dropped): the target, reading the
    repeat, copies it, and its labels there show a head the copying replies rarely do. Why: SmolLM2's MT-bench
    replies restate themselves past 128 tokens (prompt lookup drafts 3 tokens a step there), where a head drafts 1.3
    as everywhere. Measured (2026-12-07): on 71K tokens the head memorised its repeats and copied no better on new
    text; kept for trainings longer than a CPU's 30 minutes."""
    rng, low, high, out = random.Random(seed), *REPEAT_SPAN, []
    for ids, asked in zip(sequences, prompt_lengths):
        body = list(ids[:-1] if ids and ids[-1] in eos_ids else ids)
        reply, prompt = body[asked:], body[:asked]
        source = reply if len(reply) >= low and (rng.random() < 0.5 or len(prompt) < low) else prompt
        if rng.random() >= share or len(source) < low or len(body) + low > max_length:
            out.append(ids)
            continue
        length = rng.randint(low, min(high, len(source)))
        start = rng.randint(0, len(source) - length)
        out.append((body + source[start:start + length])[:max_length])
    return out


def prompt_lengths(target, spec, prompts: list) -> list[int]:
    """How many tokens of each of `sequences`' sequences (in its order) are prompt: drafting proposes only
    after them. Plain teacher-forced text has none."""
    from specbench.api import encode_prompts

    if spec.teacher_forced:
        if _exchanges(prompts):
            return [exchange(target.tokenizer, messages, spec.max_length)[1] for messages in prompts]
        return [0] * len(prompts)
    room = _prompt_room(spec)
    return [min(len(ids), room) for ids in encode_prompts(prompts, target.tokenizer)] * spec.samples


def _exchanges(prompts: list) -> bool:
    """Whole conversations (lists of messages), not prompt texts or ids."""
    return bool(prompts) and isinstance(prompts[0], list) and bool(prompts[0]) and isinstance(prompts[0][0], dict)


def _prompt_room(spec) -> int:
    """Tokens kept of a prompt's end, so the response always fits in `max_length`."""
    return max(1, spec.max_length - spec.max_new_tokens)


def exchange(tokenizer, messages: list[dict], max_length: int, context: int = 96) -> tuple[list[int], int]:
    """A user turn's last `context` tokens and the assistant's reply after it, through the chat template
    (the reply is what drafting will be asked to continue), and how many of those tokens are the turn's."""
    turns = messages[:2]
    asked = tokenizer.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(turns, tokenize=False)
    prompt_ids = tokenizer(asked, add_special_tokens=False)["input_ids"]
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    start = max(0, len(prompt_ids) - context)
    return ids[start:start + max_length], min(len(prompt_ids) - start, max_length)


@torch.inference_mode()
def target_pass(target, ids: list[int], layer_ids, top: int = 16, final: bool = False) -> tuple:
    """(the concatenated inputs of `layer_ids` per position [n, layers x hidden], the target's `top` most
    likely next ids after each position [n, top] (its greedy choice first) and their probabilities) from
    one forward; with `final`, also its final normed hidden state per position [n, hidden] (what its
    output layer reads: a feature loss's goal)."""
    output = target.model(input_ids=torch.tensor([ids]), output_hidden_states=bool(layer_ids) or final)
    raw = (torch.cat([output.hidden_states[i][0] for i in layer_ids], dim=-1) if layer_ids
           else torch.zeros(len(ids), 0))  # a distilled draft reads no features
    probs, choices = torch.softmax(output.logits[0].float(), dim=-1).topk(top, dim=-1)
    kept = (raw.to(torch.float16), choices.to(torch.int32), probs.to(torch.float16))
    return kept + (output.hidden_states[-1][0].to(torch.float16),) if final else kept


@dataclass
class Prepared:
    """What both trainings read: the target, the sequences, one target pass per sequence (features,
    its top ids and probabilities), the held-out prompts, and the seconds each phase took."""

    target: object
    folder: Path
    data: dict
    passes: list
    prompt_lengths: Optional[list]  # per sequence: its prompt's tokens (training on replies only; else None)
    held: list
    seconds: dict
    started: float


def prepare(spec, folder: str | Path, layer_ids_of, progress: bool) -> Prepared:
    """The training data of `spec` in `folder`: made (and cached) on the first run, read on a resume.
    `layer_ids_of(layers)`: the target layers whose inputs are kept (a head's; a distilled draft needs none,
    and reads a head's cached data as it is)."""
    from specbench.datasets import load_prompts
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    started, seconds = time.monotonic(), {}
    torch.manual_seed(spec.seed)
    target = load_model(ModelSpec(spec.target, dtype=spec.dtype, kernels=spec.kernels))
    layer_ids = layer_ids_of(target.model.config.num_hidden_layers)  # refused here, not after minutes of replies
    if spec.teacher_forced and spec.prompts == "sharegpt":  # whole exchanges, not the first turns alone
        from specbench.datasets.loaders import load_conversations

        conversations = load_conversations(spec.prompts, limit=spec.prompt_count, seed=spec.seed)
        held = [messages[0]["content"] for messages in conversations[:spec.held_out]]
        training = conversations[spec.held_out:]
        count = len(conversations)
    else:
        rows = (load_prompts(spec.prompts, limit=spec.prompt_count, seed=spec.seed) if isinstance(spec.prompts, str)
                else [{"prompt": prompt} for prompt in spec.prompts[:spec.prompt_count]])
        prompts = [row["prompt"] for row in rows]
        held, training, count = prompts[:spec.held_out], prompts[spec.held_out:], len(rows)
    if count < spec.held_out + 2:
        raise SpecbenchError(f"prompt set {spec.prompts!r} gave {count} prompts: too few to train on")
    data_path = folder / "data.pt"
    if data_path.exists():
        data = load_cached(data_path, "the target's responses are lost; train into a new folder, or delete this "
                                      "folder's data.pt, features.pt, checkpoint.pt and head/ to make them again")
        fields = ("prompts", "prompt_count", "held_out", "max_new_tokens", "max_length", "teacher_forced", "seed",
                  "samples", "temperature", "repeat_spans")
        made = {**asdict(type(spec)(target=spec.target)), **data["spec"]}  # fields a cache predates: their defaults
        changed = [name for name in fields if made.get(name) != asdict(spec).get(name)]
        if changed:
            raise SpecbenchError(f"{folder} holds training data made with other {changed}: resume with the same "
                                 f"settings, or train into a new folder")
    else:
        made = sequences(target, spec, training, progress)
        if spec.repeat_spans:
            made = with_repeats(made, prompt_lengths(target, spec, training), spec.repeat_spans, spec.max_length,
                                set(target.eos_token_ids or ()), spec.seed)
        data = {"sequences": made, "spec": asdict(spec)}
        save_cached(data, data_path)
    seconds["data"] = round(time.monotonic() - started, 1)
    features_path = folder / "features.pt"
    passes = None
    if features_path.exists():
        try:  # derived from data.pt alone: one that does not load is made again, said
            passes = load_cached(features_path, "making the target's features again")
        except SpecbenchError as error:
            print(f"specbench: {error}", file=sys.stderr)
    # the layers the cached features came from (a cache written before they were kept: the default ones)
    cached_layers = tuple(data.get("feature_layers", default_layer_ids(target.model.config.num_hidden_layers)))
    final = bool(getattr(spec, "feature_loss", 0))  # a feature loss also needs the target's final states
    if (passes is None or len(passes) != len(data["sequences"]) or passes[0][1].shape[-1] != spec.soft_top
            or (final and len(passes[0]) < 4)
            or (layer_ids and (passes[0][0].shape[-1] != len(layer_ids) * target.model.config.hidden_size
                               or cached_layers != tuple(layer_ids)))):
        passes = [target_pass(target, ids, layer_ids, spec.soft_top, final) for ids in tqdm(
            data["sequences"], desc="train-draft: target features", unit="sequence", disable=not progress)]
        save_cached(passes, features_path)
        if layer_ids:
            data["feature_layers"] = list(layer_ids)
            save_cached(data, data_path)
    seconds["features"] = round(time.monotonic() - started - sum(seconds.values()), 1)
    lengths = prompt_lengths(target, spec, training) if spec.loss_on == "reply" else None
    if lengths is not None and len(lengths) != len(data["sequences"]):
        raise SpecbenchError(f"{folder} holds {len(data['sequences'])} sequences for {len(lengths)} prompts: train "
                             f"into a new folder")
    return Prepared(target, folder, data, passes, lengths, held, seconds, started)
