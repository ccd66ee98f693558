"""Two tokenizers, one text: carry a context from one to the other and match tokens by what they spell.

Why bytes: a byte-level BPE vocabulary stores " world" as "Ġworld", a SentencePiece one as "▁world",
so comparing vocabulary strings would miss most matches; the bytes each token decodes to do not.
Added tokens (chat markers, EOS) match by their text. Used by the cross-tokenizer drafters.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch

from specbench.types import SpecbenchError

Key = Union[bytes, tuple]  # bytes a plain token spells, or ("added", text) for an added token
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _decoder_types(tokenizer) -> set[str]:
    """The decoder step types of a fast tokenizer ("ByteLevel", "ByteFallback", "Replace", ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise SpecbenchError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer; cross-tokenizer "
                             f"drafting reads the vocabulary's byte encoding from a fast tokenizer")
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders") or [decoder]
    return {step.get("type", "") for step in steps}


def added_tokens(tokenizer) -> dict[int, str]:
    """Id -> text of each added token (chat markers, EOS, ...)."""
    return {int(index): str(getattr(token, "content", token))
            for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}


def token_keys(tokenizer, vocab_size: int) -> list[Optional[Key]]:
    """Per id below `vocab_size`: the bytes the token spells, ("added", text) for an added token,
    None for ids the tokenizer does not define (padding rows of the output layer)."""
    byte_level = "ByteLevel" in _decoder_types(tokenizer)
    decoder = _byte_decoder()
    keys: list[Optional[Key]] = [None] * vocab_size
    for text, index in tokenizer.get_vocab().items():
        if not 0 <= index < vocab_size:
            continue
        if byte_level:
            try:
                keys[index] = bytes(decoder[char] for char in text)
            except KeyError:  # not a byte-level spelling: an added token, keyed below
                keys[index] = None
        elif match := _BYTE_FALLBACK.fullmatch(text):
            keys[index] = bytes([int(match.group(1), 16)])
        else:
            keys[index] = text.replace("\u2581", " ").encode("utf-8")
    for index, text in added_tokens(tokenizer).items():
        if 0 <= index < vocab_size:
            keys[index] = ("added", text)
    return keys


@dataclass(frozen=True)
class SharedVocab:
    """Draft ids and target ids that spell the same thing, one to one (the first id of each spelling).

    `draft_ids[i]` and `target_ids[i]` are a pair; `draft_mask` marks the draft ids in a pair.
    """

    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    draft_mask: torch.Tensor
    draft_to_target: dict
    target_to_draft: dict

    @classmethod
    def build(cls, draft_tokenizer, draft_vocab_size: int, target_tokenizer, target_vocab_size: int) -> "SharedVocab":
        first_target: dict[Key, int] = {}
        for index, key in enumerate(token_keys(target_tokenizer, target_vocab_size)):
            if key is not None:
                first_target.setdefault(key, index)
        pairs, seen = [], set()
        for index, key in enumerate(token_keys(draft_tokenizer, draft_vocab_size)):
            if key is not None and key in first_target and key not in seen:
                seen.add(key)
                pairs.append((index, first_target[key]))
        if not pairs:
            raise SpecbenchError("the draft and target vocabularies share no token, so the shared-vocabulary "
                                 "rule has nothing to propose; use the text rule (cross_tokenizer='text')")
        draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
        mask = torch.zeros(draft_vocab_size, dtype=torch.bool)
        mask[draft_ids] = True
        return cls(draft_ids, torch.tensor([t for _, t in pairs], dtype=torch.long), mask,
                   dict(pairs), {t: d for d, t in pairs})

    def __len__(self) -> int:
        return len(self.draft_ids)


class TextBridge:
    """Carry token ids from the target's tokenizer to the draft's through text, and new draft text back.

    The target's context is decoded with its special tokens kept and encoded by the draft's
    tokenizer (with the draft's own start-of-text token, if it adds one), so chat markers both
    tokenizers know stay single tokens. New draft tokens become text as the continuation of the
    draft context (decoded together with a few tokens before them, so leading spaces and merged
    bytes come out right) and that text is encoded alone by the target's tokenizer: the target's
    next token starts exactly where its committed context ends.
    """

    WINDOW = 8  # draft tokens decoded before the new ones, for spacing and multi-byte characters

    def __init__(self, draft_tokenizer, target_tokenizer):
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.draft_added = added_tokens(draft_tokenizer)
        self.target_added = {text: index for index, text in added_tokens(target_tokenizer).items()}

    def to_draft(self, target_ids: list[int]) -> list[int]:
        text = self.target_tokenizer.decode(target_ids, skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)
        ids = self.draft_tokenizer(text, add_special_tokens=True)["input_ids"]
        eos = self.draft_tokenizer.eos_token_id
        if len(ids) > 1 and eos is not None and ids[-1] == eos and not text.endswith(str(self.draft_tokenizer.eos_token)):
            ids = ids[:-1]  # a tokenizer that closes every text with EOS: the context is not closed
        return ids

    def new_text(self, context: list[int], new: list[int]) -> str:
        """The text `new` draft tokens add after `context`, up to its last complete character."""
        window = context[-self.WINDOW:]
        decode = lambda ids: self.draft_tokenizer.decode(ids, skip_special_tokens=False,  # noqa: E731
                                                         clean_up_tokenization_spaces=False)
        # a character whose first bytes end the context is completed by the new tokens: it is new text
        before, after = decode(window).rstrip(REPLACEMENT), decode(window + new)
        text = after[len(before):] if after.startswith(before) else decode(new)
        return text.rstrip(REPLACEMENT)

    def to_target(self, text: str) -> list[int]:
        return self.target_tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def added_in_target(self, draft_id: int) -> Optional[int]:
        """The target id of a draft added token (EOS, chat marker) spelled the same, else None."""
        text = self.draft_added.get(draft_id)
        return None if text is None else self.target_added.get(text)

    def is_added(self, draft_id: int) -> bool:
        return draft_id in self.draft_added
