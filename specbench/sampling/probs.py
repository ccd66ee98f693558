"""Logits -> probabilities as the sampling settings say, and draws from them with passed-in randomness.

p = target, q = draft (Leviathan et al.) throughout the sampling package.
"""
from __future__ import annotations

import torch

from specbench.types import SamplingParams, SparseDist


def processed_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax, row by row, in float32.

    logits: [num_rows, vocab_size]; returns [num_rows, vocab_size]. Under greedy settings the
    result is one-hot on the argmax, so every verification rule sees the same distribution.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; keeps at least one.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a probability vector [vocab_size] by inverting the CDF at a passed-in uniform."""
    cumulative = probs.double().cumsum(-1)
    coin = torch.rand((), generator=generator, dtype=torch.float64) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, coin.reshape(1), right=True).item())
    index = min(index, probs.shape[-1] - 1)
    # Never return a zero-probability token (possible only at floating-point boundaries).
    while probs[index] <= 0 and index > 0:
        index -= 1
    return index


def coupled_draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a probability vector [vocab_size] by the Gumbel-max trick, argmax(log p + G), G from
    `generator`: as exact as inverting the CDF, and a draft that perturbs its own q with the same G
    (`coupled_draw_sparse`, the same generator) lands on the same token at least (1 - TV) / (1 + TV) of
    the time (TV the distance between p and q), where independent draws would agree sum p * q of it.
    Computed as the race argmax(p / E), E = -log U = exp(-G): one log, in float32 (0.7 ms at 49K ids on
    one core, a third of the double-log float64 form; the uniforms themselves are most of it)."""
    return int((probs.float() / _exponentials(probs.shape[-1], generator)).argmax().item())


def coupled_draw_sparse(dist: SparseDist, generator: torch.Generator) -> int:
    """`coupled_draw` for a sparse q: the same E (its first max(ids) + 1 values, which a longer draw starts
    with: `tests/test_verify_rules.py` checks it), read at q's ids."""
    return coupled_top(dist, generator, 1)[0]


def coupled_top(dist: SparseDist, generator: torch.Generator, count: int) -> list[int]:
    """The `count` leaders of `coupled_draw_sparse`'s race, best first: a draw of `count` tokens without
    replacement from q (Gumbel top-k), the first of them the coupled draw. A tree's children under
    sample-match: the target's draw there is among them as often as the race's order allows."""
    race = torch.tensor(dist.probs, dtype=torch.float32) / _exponentials(max(dist.ids) + 1, generator)[list(dist.ids)]
    return [dist.ids[i] for i in race.argsort(descending=True, stable=True)[:count].tolist()]


def _exponentials(size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(size, generator=generator).log_().neg_()


def draft_distribution(draft_logits: torch.Tensor, sampling: SamplingParams) -> SparseDist:
    """The exactly sparse draft distribution q: the draft's processed probabilities truncated to
    their top `draft_top_k` and renormalised. Sampling from exactly this q keeps rejection exact.

    draft_logits: [vocab_size].
    """
    probs = processed_probs(draft_logits.unsqueeze(0), sampling)[0]
    k = min(sampling.draft_top_k, int((probs > 0).sum().item()))
    top = torch.topk(probs, k)
    values = top.values / top.values.sum()
    return SparseDist(tuple(int(i) for i in top.indices.tolist()), tuple(float(v) for v in values.tolist()))


def sample_sparse(dist: SparseDist, generator: torch.Generator) -> int:
    """One draw from a sparse distribution, by the same CDF inversion as `sample_from`."""
    index = sample_from(torch.tensor(dist.probs, dtype=torch.float64), generator)
    return dist.ids[index]


def dense(dist: SparseDist, vocab_size: int) -> torch.Tensor:
    """A sparse q as a [vocab_size] float32 vector, built on the verifying side only."""
    out = torch.zeros(vocab_size, dtype=torch.float64)
    out[list(dist.ids)] = torch.tensor(dist.probs, dtype=torch.float64)
    return out


def draft_draw(sampling: SamplingParams):
    """How a chain draft draws each token from its q: under sample-match with the target's own G
    (`coupled_draw_sparse`), else by inverting q's CDF (what rejection's q describes)."""
    return coupled_draw_sparse if sampling.effective_rule == "sample-match" else sample_sparse
