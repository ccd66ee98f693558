"""Drafters propose a DraftTree from the committed context: a draft model, prompt lookup, self-draft."""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specbench.decode.kv import cached_length, crop_to
from specbench.models.loading import LoadedModel
from specbench.sampling.probs import draft_distribution, sample_sparse
from specbench.types import DraftTree, SamplingParams, SparseDist, SpecbenchError


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], budget: int, sampling: SamplingParams,
                generator: torch.Generator) -> DraftTree: ...


class ModelDrafter:
    """Chain drafts from a causal LM, each token drawn from the exact sparse q it reports.

    The drafter keeps its own KV cache and syncs it to whatever context it is given by the longest
    common prefix, so it needs no notice of which tokens the target accepted.
    """

    def __init__(self, draft: LoadedModel, target_vocab_size: int, name: str = "draft"):
        self.draft = draft
        self.model = draft.model
        self.name = name
        # Padded vocabularies: ids at or past the target's size never get proposed.
        self.vocab_limit = min(draft.vocab_size, target_vocab_size)
        self.cache = None
        self.cached_ids: list[int] = []

    def propose(self, context: Sequence[int], budget: int, sampling: SamplingParams,
                generator: torch.Generator) -> DraftTree:
        if budget < 1:
            raise SpecbenchError(f"draft budget must be >= 1, got {budget}")
        logits = self._sync(list(context))
        tokens: list[int] = []
        dists: list[SparseDist] = []
        for position in range(budget):
            dist = draft_distribution(logits[: self.vocab_limit], sampling)
            token = sample_sparse(dist, generator)
            tokens.append(token)
            dists.append(dist)
            if position + 1 < budget:
                logits = self._extend([token])
        return DraftTree.chain(tokens, dists)

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Crop the cache to the common prefix (leaving at least the last token to feed); feed the rest."""
        from transformers import DynamicCache

        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        common = 0
        for cached, token in zip(self.cached_ids, context):
            if cached != token:
                break
            common += 1
        common = min(common, len(context) - 1, cached_length(self.cache))
        crop_to(self.cache, common)
        self.cached_ids = self.cached_ids[:common]
        return self._extend(context[common:])

    @torch.inference_mode()
    def _extend(self, token_ids: list[int]) -> torch.Tensor:
        device = self.model.get_input_embeddings().weight.device
        output = self.model(input_ids=torch.tensor([token_ids], device=device),
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached_ids += token_ids
        return output.logits[0, -1].float().cpu()


class PromptLookupDrafter:
    """N-gram prompt lookup: continue the context the way it continued after the same n-gram before.

    Example: context [1, 2, 3, 4, 2, 3] with max_ngram 2 matches the trailing (2, 3) at position 1,
    so a budget of 2 proposes [4, 2]. Longer n-grams are tried first, then shorter; the most recent
    earlier match wins. The proposal is deterministic, so q is a point mass (exact for rejection).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "prompt-lookup"):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecbenchError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name

    def propose(self, context: Sequence[int], budget: int, sampling: SamplingParams,
                generator: torch.Generator) -> DraftTree:
        if budget < 1:
            raise SpecbenchError(f"draft budget must be >= 1, got {budget}")
        tokens = self.lookup(list(context), budget)
        return DraftTree.chain(tokens, [SparseDist((t,), (1.0,)) for t in tokens])

    def lookup(self, context: list[int], budget: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    return context[start + n:start + n + budget]
        return []
