"""Drafters propose a DraftTree from the committed context: a draft model, prompt lookup, self-draft."""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from specbench.decode import packed_attention
from specbench.decode.kv import cached_length, can_crop_to, common_prefix, crop_to, new_cache
from specbench.models.loaded import LoadedModel
from specbench.sampling.probs import draft_distribution, draft_draw
from specbench.sampling.streams import DraftDraws, draft_draws
from specbench.types import DraftTree, SamplingParams, SparseDist, SpecbenchError, check_stop_below


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                draws: DraftDraws | torch.Generator, max_depth: Optional[int] = None) -> DraftTree:
        """At most `k` nodes and `max_depth` levels (the loop caps depth near max_new_tokens); the
        token at absolute position i is drawn with `draws.at(i)`."""


def _capped(k: int, max_depth: Optional[int]) -> int:
    if max_depth is not None and max_depth < 1:
        raise SpecbenchError(f"max_depth must be >= 1, got {max_depth}")
    return k if max_depth is None else min(k, max_depth)


class ModelDrafter:
    """Chain drafts from a causal LM, each token drawn from the exact sparse q it reports.

    The drafter keeps its own KV cache and syncs it to whatever context it is given by the longest
    common prefix, so it needs no notice of which tokens the target accepted.
    """

    def __init__(self, draft: LoadedModel, target_vocab_size: int, name: str = "draft", fast=None,
                 stop_below: float = 0.0):
        self.draft = draft
        # a chain ends after a token the draft gave less than this probability (its own softmax, whatever the
        # sampling): Hugging Face's assistant_confidence_threshold. K is then a cap; 0 drafts all K
        self.stop_below = check_stop_below(stop_below)
        self.model = draft.model
        self.name = name
        self.fast = fast  # a FastForward over the draft model: fixed-shape steps on a static cache
        if fast is None:  # its one-token steps attend folded on a CPU, as the target's do (`packed_attention.sdpa`)
            packed_attention.install(self.model)
        # Padded vocabularies: ids at or past the target's size never get proposed.
        self.vocab_limit = min(draft.vocab_size, target_vocab_size)
        self.cache = None
        self.cached_ids: list[int] = []

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                draws: DraftDraws | torch.Generator, max_depth: Optional[int] = None) -> DraftTree:
        """A chain of `k` tokens, each drawn from the exact sparse q it reports."""
        if k < 1:
            raise SpecbenchError(f"draft budget must be >= 1, got {k}")
        k, draws = _capped(k, max_depth), draft_draws(draws)
        context = list(context)
        logits = self._sync(context)
        tokens: list[int] = []
        dists: list[SparseDist] = []
        draw = draft_draw(sampling)
        for position in range(k):
            dist = draft_distribution(logits[: self.vocab_limit], sampling)
            tokens.append(draw(dist, draws.at(len(context) + position)))
            dists.append(dist)
            if position + 1 == k or self._unsure(logits, tokens[-1]):
                break
            logits = self._extend(tokens[-1:])
        return DraftTree.chain(tokens, dists)

    def _unsure(self, logits: torch.Tensor, token: int) -> bool:
        """Whether the draft gave `token` less than `stop_below` (a stop that depends only on what was drafted
        keeps every verification rule exact: each position is verified as before, a stop only ends the chain)."""
        if not self.stop_below:
            return False
        return float(torch.softmax(logits[: self.vocab_limit].float(), -1)[token]) < self.stop_below

    def pending(self, context: Sequence[int]) -> int:
        """How many tokens of `context` a proposal would first feed: those past the cache's common prefix with it
        (the whole context on a fresh cache; at least its last token)."""
        return len(context) - min(common_prefix(self.cached_ids, context), max(len(context) - 1, 0))

    def warm(self, context: Sequence[int], max_tokens: int) -> bool:
        """Feed up to `max_tokens` more of `context` (all but its last token) into the cache; True once
        fed. A shared worker takes a long prompt into its draft this way, a bounded piece per slice."""
        context = list(context)
        common = self._keep_common(context)
        piece = context[common:len(context) - 1][:max_tokens]
        if piece:
            self._extend(piece)
        return common + len(piece) >= len(context) - 1

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Crop the cache to the common prefix (leaving at least the last token to feed); feed the rest."""
        return self._extend(context[self._keep_common(context):])

    def _keep_common(self, context: list[int]) -> int:
        """Crop the cache to its longest common prefix with `context`, leaving at least the last token
        to feed; returns that prefix's length."""
        if self.cache is None:
            self.cache = self.fast.new_cache() if self.fast else new_cache(self.model.config)
        common = min(common_prefix(self.cached_ids, context), len(context) - 1, cached_length(self.cache))
        if not can_crop_to(self.cache, common):  # sliding-window layers dropped what this rollback needs
            self.cache, self.cached_ids, common = new_cache(self.model.config), [], 0
        crop_to(self.cache, common)
        self.cached_ids = self.cached_ids[:common]
        return common

    @torch.inference_mode()
    def _extend(self, token_ids: list[int]) -> torch.Tensor:
        if self.fast is not None:
            logits = self.fast(self.cache, token_ids, logits_to_keep=1)
            self.cached_ids += token_ids
            return logits[-1].float().cpu()
        device = self.model.get_input_embeddings().weight.device
        output = self.model(input_ids=torch.tensor([token_ids], device=device),
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached_ids += token_ids
        return output.logits[0, -1].float().cpu()


class PromptLookupDrafter:
    """N-gram prompt lookup: continue the context the way it continued after the same n-gram before.

    Example: context [1, 2, 3, 4, 2, 3] with max_ngram 2 matches the trailing (2, 3) at position 1,
    so a budget of 2 proposes [4, 2]. Longer n-grams are tried first, then shorter; the most recent
    earlier match wins. With `max_candidates` > 1 the most recent distinct continuations are merged
    into a token tree (a trie). Proposals are deterministic, so each node's q is a point mass, which
    keeps rejection exact, siblings included.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_candidates: int = 1,
                 name: str = "prompt-lookup"):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecbenchError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_candidates < 1:
            raise SpecbenchError(f"max_candidates must be >= 1, got {max_candidates}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, name
        self.max_candidates = max_candidates

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                draws: DraftDraws | torch.Generator, max_depth: Optional[int] = None) -> DraftTree:
        if k < 1:
            raise SpecbenchError(f"draft budget must be >= 1, got {k}")
        candidates = self.candidates(list(context), _capped(k, max_depth))
        if self.max_candidates == 1:
            tokens = candidates[0] if candidates else []
            return DraftTree.chain(tokens, [SparseDist((t,), (1.0,)) for t in tokens])
        return trie(candidates, k, point_masses=True)

    def lookup(self, context: list[int], budget: int) -> list[int]:
        candidates = self.candidates(context, budget)
        return candidates[0] if candidates else []

    def candidates(self, context: list[int], budget: int) -> list[list[int]]:
        """Up to max_candidates distinct continuations, longest n-gram and most recent match first."""
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    continuation = context[start + n:start + n + budget]
                    if continuation not in found:
                        found.append(continuation)
                        if len(found) == self.max_candidates:
                            return found
            if found:
                return found
        return found


def trie(candidates: list[list[int]], budget: int, point_masses: bool = False) -> DraftTree:
    """Token sequences merged into one tree of at most `budget` nodes, earlier sequences first.

    Example: [[4, 2], [4, 7], [9]] with budget 3 gives tokens (4, 2, 7), parents (-1, 0, 0).
    `point_masses`: each node's q is a point mass on its token, exact for deterministic proposals
    (prompt lookup); otherwise nodes carry no q.
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for continuation in candidates:
        parent = -1
        for token in continuation:
            node = index.get((parent, token))
            if node is None:
                if len(tokens) == budget:
                    break
                tokens.append(token)
                parents.append(parent)
                node = index[(parent, token)] = len(tokens) - 1
            parent = node
    dists = tuple(SparseDist((t,), (1.0,)) for t in tokens) if point_masses else None
    return DraftTree(tuple(tokens), tuple(parents), dists)
