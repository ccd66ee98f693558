"""Verification rules: which draft nodes the target accepts and which token it adds itself.

p = target, q = draft (Leviathan et al.). `target_logits` has one row per tree position:
row 0 is the target's next-token logits after the last committed token (the root), row i+1 the
logits after draft node i. Each rule walks the tree from the root and stops at the first
position where no child is accepted; the token it emits there is the bonus/recovered token.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from specbench.sampling.probs import coupled_draw, dense, processed_probs, sample_from
from specbench.sampling.streams import position_generator
from specbench.types import DraftTree, SamplingParams, SpecbenchError


def verify(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams,
           generator: torch.Generator, choices: Optional[list[int]] = None,
           position: Optional[int] = None) -> tuple[tuple[int, ...], int]:
    """Dispatch on the effective rule; returns (accepted node path, bonus token).

    target_logits: [num_nodes + 1, vocab_size], on the target's device. Only what the walk needs
    leaves it: the argmax ids under greedy (one small copy), else the processed rows it visits.
    `choices`: those argmax ids, where the caller read them already (a batch reads every greedy
    row's in one transfer: on a GPU each read is a synchronization).
    `position`: the absolute index of the token the root row predicts (the session's committed
    length). Given, sample-match draws the token at position t by `coupled_draw` from
    `position_generator(generator's seed, t)`, so the text depends on the seed and not on the draft
    (and a draft coupled to the same draws lands on it often); without it, from `generator`.
    """
    if target_logits.shape[0] != len(tree) + 1:
        raise SpecbenchError(
            f"target logits have {target_logits.shape[0]} rows; a {len(tree)}-node tree needs {len(tree) + 1}")
    rule = sampling.effective_rule
    if rule == "greedy":  # processed_probs is one-hot on the logits' argmax: take the argmax directly
        target_choices = choices if choices is not None else target_logits.argmax(-1).tolist()
        return _walk(tree, lambda node: target_choices[node + 1])
    row_probs = _RowProbs(target_logits, sampling)
    if rule == "sample-match":
        if position is None:
            return _walk(tree, lambda node: sample_from(row_probs(node), generator))
        depths, seed = tree.depths(), generator.initial_seed()
        return _walk(tree, lambda node: coupled_draw(
            row_probs(node), position_generator(seed, position + (depths[node] if node >= 0 else 0))))
    if tree.draft_dists is None and len(tree):
        raise SpecbenchError(
            "rejection sampling needs the draft distribution q of every node; this drafter sends "
            "none, so use rule='sample-match' (lossless without q)")
    return _recursive_rejection(tree, row_probs, generator)


class _RowProbs:
    """Processed target probabilities per tree position, computed (on the logits' device) only for
    the rows visited and brought to the CPU one row at a time, where the passed-in generator draws."""

    def __init__(self, target_logits: torch.Tensor, sampling: SamplingParams):
        self.logits, self.sampling = target_logits, sampling
        self.row = lru_cache(maxsize=None)(self._row)

    def _row(self, node: int) -> torch.Tensor:
        return processed_probs(self.logits[node + 1].unsqueeze(0), self.sampling)[0].cpu()

    def __call__(self, node: int) -> torch.Tensor:
        return self.row(node)


def _walk(tree: DraftTree, choose) -> tuple[tuple[int, ...], int]:
    """Follow the child whose token equals the target's choice at each position.

    Greedy example: tree tokens (5, 7, 9) as a chain, target argmaxes per row (5, 7, 4, 1):
    nodes 0 and 1 match, row 2 says 4 != 9, so the path is (0, 1) and the bonus is 4.
    Lossless for sample-match because every emitted token is a fresh draw from p at its position;
    the draft only decides how many of those draws one forward pass can check. Keyed by position,
    each position is drawn with its own uniforms whichever step reaches it, so the emitted text is
    target-only's under the same seed, token for token, whatever the draft.
    """
    path: list[int] = []
    node = -1
    while True:
        token = choose(node)
        match = next((child for child in tree.children(node) if tree.tokens[child] == token), None)
        if match is None:
            return tuple(path), token
        path.append(match)
        node = match


def _recursive_rejection(tree: DraftTree, row_probs, generator: torch.Generator) -> tuple[tuple[int, ...], int]:
    """Residual rejection sampling, recursive over siblings (SpecInfer / Chen et al. multi-draft).

    At a position with children x_1..x_m, each drawn independently from the same q: accept x_j
    with probability min(1, p(x_j) / q(x_j)); on rejection replace p by norm(max(p - q, 0)) and
    try the next sibling; if every sibling is rejected, draw the recovered token from the final
    residual. For one child this is Leviathan et al.'s rule, whose output is distributed exactly
    as p: P(emit x) = min(p, q)(x) + (1 - sum min(p, q)) * (p - q)+(x) / sum (p - q)+ = p(x).
    Applied recursively, each sibling trial samples the residual target exactly (SpecInfer, Thm 4.2).
    Example: p = {a: .6, b: .4}, q = {a: .9, b: .1}, draft a: accept with .6/.9; the residual is
    {b: 1}, so a rejection emits b; overall P(a) = .9 * 2/3 = .6.
    """
    path: list[int] = []
    node = -1
    while True:
        target_p = row_probs(node).double()
        accepted = None
        for child in tree.children(node):
            draft_q = dense(tree.draft_dists[child], target_p.shape[-1])
            token = tree.tokens[child]
            if draft_q[token] <= 0:
                raise SpecbenchError(f"draft node {child} has token {token} outside its own q")
            coin = torch.rand((), generator=generator, dtype=torch.float64)
            if coin * draft_q[token] < target_p[token]:
                accepted = child
                break
            residual = (target_p - draft_q).clamp_min(0)
            if residual.sum() > 0:  # sum 0 means p == q, where rejection had probability 0
                target_p = residual / residual.sum()
        if accepted is None:
            return tuple(path), sample_from(target_p, generator)
        path.append(accepted)
        node = accepted
