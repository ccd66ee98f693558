"""Drafts from a model with another tokenizer than the target's, proposed in the target's token ids.

The draft reads the committed context re-tokenized through text (`TextBridge.to_draft`) and keeps
its own KV cache in sync by the longest common prefix of draft ids, as `ModelDrafter` does. Two rules
turn its proposals into target ids:

- text (HF's `AssistedCandidateGeneratorDifferentTokenizers` idea): the draft writes text, the
  target's tokenizer cuts it into target ids, and the target checks them by exact match (greedy or
  sample-match verification). Lossless with no q at all: every emitted token is the target's own
  choice at its position; the draft only decides how many positions one forward checks. Chains and
  trees (each root-to-leaf path of a draft tree re-tokenized, the paths merged into a target trie).
- shared-vocab (Universal Speculative Decoding's idea): the draft's distribution is restricted to
  the ids both vocabularies spell the same way and renormalised; that q, stated in target ids, is
  what the token is drawn from and what travels with it, so rejection sampling applies.
  Proof sketch: for any q, accepting x ~ q with probability min(1, p(x)/q(x)) and otherwise drawing
  from norm(max(p - q, 0)) emits y with probability min(p, q)(y) + (1 - sum min(p, q)) *
  (p - q)+(y) / sum (p - q)+ = p(y), because sum (p - q)+ = 1 - sum min(p, q). Nothing requires q's
  support to cover p's: tokens only the target has (q = 0) come from the residual. Chains only.

`auto` picks shared-vocab when the verification rule is rejection (it needs q) and text otherwise.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specbench.decode.drafters import ModelDrafter, trie
from specbench.decode.tree_drafters import TreeDrafter
from specbench.models.loaded import LoadedModel
from specbench.models.vocab_bridge import SharedVocab, TextBridge
from specbench.sampling.probs import draft_distribution, sample_sparse
from specbench.sampling.streams import DraftDraws, draft_draws
from specbench.types import CROSS_TOKENIZER_RULES, DraftTree, SamplingParams, SparseDist, SpecbenchError


class CrossTokenizerDrafter:
    """A draft model whose tokenizer is not the target's, drafting chains (or trees) of target ids.

    `k` counts target tokens (nodes), the unit the target verifies and the records count. In the
    text rule a chain drafts until its text holds more than `k` target tokens (so the k-th ends
    where the draft's text went on) or until `k + slack` draft tokens; `draft_tokens` on the tree
    says how many draft tokens it took.
    """

    def __init__(self, draft: LoadedModel, target_tokenizer, target_vocab_size: int, rule: str = "auto",
                 tree: Optional[dict] = None, name: str = "cross", slack: int = 2, fast=None,
                 stop_below: float = 0.0):
        if rule not in CROSS_TOKENIZER_RULES:
            raise SpecbenchError(f"unknown cross-tokenizer rule {rule!r}; choose one of {CROSS_TOKENIZER_RULES}")
        if draft.tokenizer is None or target_tokenizer is None:
            raise SpecbenchError("a draft with another vocabulary needs both tokenizers to translate through "
                                 "text; pass the target's tokenizer (RemoteTarget(..., tokenizer=...))")
        self.draft, self.rule, self.name, self.slack = draft, rule, name, slack
        self.target_vocab_size = target_vocab_size
        self.bridge = TextBridge(draft.tokenizer, target_tokenizer)
        self.model_drafter = (TreeDrafter(draft, draft.vocab_size, name=name, **tree) if tree is not None
                              else ModelDrafter(draft, draft.vocab_size, name=name, fast=fast, stop_below=stop_below))
        self.is_tree = tree is not None
        # ids past the tokenizer's own (padding rows of the output layer) spell nothing
        self.draft_vocab = min(draft.vocab_size, len(draft.tokenizer))
        self._shared: Optional[SharedVocab] = None

    @property
    def shared(self) -> SharedVocab:
        if self._shared is None:
            self._shared = SharedVocab.build(self.draft.tokenizer, self.draft.vocab_size,
                                             self.bridge.target_tokenizer, self.target_vocab_size)
        return self._shared

    def rule_for(self, sampling: SamplingParams) -> str:
        if self.rule != "auto":
            return self.rule
        return "shared-vocab" if sampling.effective_rule == "rejection" and not self.is_tree else "text"

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                draws: DraftDraws | torch.Generator, max_depth: Optional[int] = None) -> DraftTree:
        if k < 1:
            raise SpecbenchError(f"draft budget must be >= 1, got {k}")
        context, draws = list(context), draft_draws(draws)
        rule = self.rule_for(sampling)
        if rule == "shared-vocab":
            if self.is_tree:
                raise SpecbenchError("the shared-vocabulary rule drafts chains; draft trees across tokenizers "
                                     "with the text rule (cross_tokenizer='text')")
            return self._shared_chain(context, min(k, max_depth or k), sampling, draws)
        if sampling.effective_rule == "rejection":
            raise SpecbenchError("the text rule proposes re-tokenized text with no q, so it verifies by exact "
                                 "match: use rule='sample-match' (lossless), or the shared-vocabulary rule "
                                 "(cross_tokenizer='shared-vocab') for rejection sampling")
        if self.is_tree:
            return self._text_tree(context, k, max_depth, sampling, draws)
        return self._text_chain(context, min(k, max_depth or k), sampling, draws)

    def _text_chain(self, context, k, sampling, draws) -> DraftTree:
        draft_context = self.bridge.to_draft(context)
        logits = self.model_drafter._sync(draft_context)
        new: list[int] = []
        proposal: list[int] = []
        while len(new) < k + self.slack:
            dist = draft_distribution(logits[: self.draft_vocab], sampling)
            token = sample_sparse(dist, draws.at(len(context) + len(new)))
            if self.bridge.is_added(token):  # EOS or a chat marker: ends the text here
                marker = self.bridge.added_in_target(token)
                proposal = self.bridge.to_target(self.bridge.new_text(draft_context, new))
                if marker is not None:
                    proposal.append(marker)
                new.append(token)
                break
            new.append(token)
            proposal = self.bridge.to_target(self.bridge.new_text(draft_context, new))
            if len(proposal) > k or self.model_drafter._unsure(logits[: self.draft_vocab], token):
                break
            logits = self.model_drafter._extend([token])
        return DraftTree(tuple(proposal[:k]), tuple(range(-1, min(k, len(proposal)) - 1)),
                         draft_tokens=len(new), cross_tokenizer="text")

    def _text_tree(self, context, k, max_depth, sampling, draws) -> DraftTree:
        draft_context = self.bridge.to_draft(context)
        ranking = sampling if sampling.greedy else SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            rule="sample-match", draft_top_k=sampling.draft_top_k)
        # its positions count draft tokens, not the target's: the target's draws there are no guide
        tree = self.model_drafter.propose(draft_context, k, ranking, DraftDraws(draws.seed))
        candidates = []
        for leaf in _leaves_depth_first(tree):
            path = _path(tree, leaf)
            tokens = [tree.tokens[n] for n in path]
            cut = next((i for i, t in enumerate(tokens) if self.bridge.is_added(t)), None)
            ids = self.bridge.to_target(self.bridge.new_text(draft_context, tokens[:cut]))
            if cut is not None and (marker := self.bridge.added_in_target(tokens[cut])) is not None:
                ids.append(marker)
            candidates.append(ids[:max_depth] if max_depth else ids)
        merged = trie([c for c in candidates if c], k)
        return DraftTree(merged.tokens, merged.parents, draft_tokens=len(tree), cross_tokenizer="text")

    def _shared_chain(self, context, k, sampling, draws) -> DraftTree:
        shared = self.shared
        draft_context = self.bridge.to_draft(context)
        logits = self.model_drafter._sync(draft_context)
        tokens: list[int] = []
        dists: list[SparseDist] = []
        for position in range(k):
            restricted = logits[: len(shared.draft_mask)].masked_fill(~shared.draft_mask, float("-inf"))
            q_draft = draft_distribution(restricted, sampling)
            pairs = [(shared.draft_to_target[i], p) for i, p in zip(q_draft.ids, q_draft.probs) if p > 0]
            if not pairs:
                break
            q = SparseDist(tuple(i for i, _ in pairs), tuple(p for _, p in pairs))
            tokens.append(sample_sparse(q, draws.at(len(context) + position)))
            dists.append(q)
            own = shared.target_to_draft[tokens[-1]]
            if position + 1 == k or self.model_drafter._unsure(restricted, own):
                break
            logits = self.model_drafter._extend([own])
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)), tuple(dists),
                         draft_tokens=len(tokens), cross_tokenizer="shared-vocab")


def _path(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def _leaves_depth_first(tree: DraftTree) -> list[int]:
    """Leaves in depth-first order, first children first: the draft's most likely path leads."""
    leaves, stack = [], list(reversed(tree.children(-1)))
    while stack:
        node = stack.pop()
        children = tree.children(node)
        if not children:
            leaves.append(node)
        stack.extend(reversed(children))
    return leaves
