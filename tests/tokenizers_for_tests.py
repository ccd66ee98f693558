"""Small tokenizers built here (no hub): a byte-level BPE and a SentencePiece-style BPE with byte
fallback, trained on one corpus so they cut the same text differently; and a vocabulary-permuted
copy of a model with its tokenizer, which reads text exactly like the original under other ids."""
from __future__ import annotations

import json

import torch

from specbench.models.loaded import LoadedModel
from specbench.models.spec import ModelSpec

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "hello world, hello there, world peace",
    "for i in range(10):\n    print(i * i)\n",
    "naïve café résumé",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def _fast(tokenizer, eos: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)


def byte_level_bpe(vocab_size: int = 330, ascii_only: bool = False):
    """GPT-2 style: every byte is a token ("Ġ" marks a space), merges learned from the corpus.
    `ascii_only`: only the ASCII characters of the corpus, so any sequence of its tokens is valid
    text (random tiny models would otherwise emit lone UTF-8 continuation bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [text for text in CORPUS if text.isascii()] if ascii_only else CORPUS
    alphabet = [] if ascii_only else pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet))
    return _fast(tokenizer, SPECIALS[0])


def sentencepiece_bpe(vocab_size: int = 140, specials: tuple[str, ...] = ("<eos>",)):
    """SentencePiece style: "▁" for spaces, characters of the corpus, and <0xNN> tokens for every
    byte, so a character it has never seen ("東") is spelled in bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials)))
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return _fast(Tokenizer.from_str(json.dumps(spec)), specials[0])


def tiny_with_tokenizer(tokenizer, seed: int) -> LoadedModel:
    from specbench.models.tiny import tiny_model

    loaded = tiny_model(seed=seed, vocab_size=len(tokenizer))
    loaded.tokenizer = tokenizer
    loaded.model.generation_config.eos_token_id = tokenizer.eos_token_id
    return loaded


def permuted(loaded: LoadedModel, seed: int = 0) -> LoadedModel:
    """The same model under a shuffled vocabulary (regular tokens only; added tokens keep their ids):
    every id means another token than in `loaded`, while the text it reads and writes is the same."""
    import copy

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = loaded.tokenizer
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    added = {entry["id"] for entry in spec.get("added_tokens", [])}
    regular = sorted(i for i in vocab.values() if i not in added)
    shuffled = torch.tensor(regular)[torch.randperm(len(regular), generator=torch.Generator().manual_seed(seed))]
    new_id = dict(zip(regular, shuffled.tolist()))
    spec["model"]["vocab"] = {token: new_id.get(i, i) for token, i in vocab.items()}
    new_tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                            eos_token=tokenizer.eos_token, bos_token=tokenizer.bos_token)
    new_tokenizer.chat_template = tokenizer.chat_template
    model = copy.deepcopy(loaded.model)
    order = torch.arange(model.get_input_embeddings().weight.shape[0])
    order[shuffled] = torch.tensor(regular)  # new row new_id[i] holds old row i
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(loaded.model.get_input_embeddings().weight[order])
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.copy_(loaded.model.get_output_embeddings().weight[order])
    return LoadedModel(spec=ModelSpec(model=f"{loaded.spec.model}-permuted{seed}"), model=model,
                       tokenizer=new_tokenizer)
