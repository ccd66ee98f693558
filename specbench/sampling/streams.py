"""The seeded randomness of one generation, split into streams so that none depends on timing.

p = target, q = draft (Leviathan et al.). Three streams, derived from one seed:
- draft draws, keyed by the absolute position of the token being drawn: a token drafted ahead
  (proactive drafting, while a verify is still in flight) is the very token a plain step would
  draw there later, so how fast a reply comes back changes no output;
- verify seeds, one per step in step order, for the target's side of the rejection rule;
- under sample-match, one seed for the whole generation, from which the target keys its draw of
  each position (`position_generator`): the token at position t is F(p_t, G_t) whatever was
  drafted, so a seed gives the same text under every draft, and under target-only. The draft's
  draws are then the very same (its stream gets that seed): a draft model perturbs its q with the
  G_t the target will use (`probs.coupled_draw_sparse`), so it proposes the target's draw as often
  as p and q allow. Still lossless: sample-match emits the target's draws, whatever was drafted.

Why reusing a position's draws is still lossless: a position is drafted again only if no verify
examined it (verification stops at the first rejected node, and the next draft starts after the
bonus token), so its uniforms are independent of everything observed so far.
Example: seed 7 -> the draft token at position 12 is drawn from `draws.at(12)`, whichever step
drafts it; the 3rd verify gets the 3rd number of the verify stream.
"""
from __future__ import annotations

import torch

_MASK = 2**64 - 1


def mix(seed: int, salt: int) -> int:
    """splitmix64 of (seed, salt): well-spread 63-bit seeds from neighbouring inputs."""
    z = (seed * 0x9E3779B97F4A7C15 + salt * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def position_generator(seed: int, position: int) -> torch.Generator:
    """A fresh generator for the token at absolute `position`: the draft's (`DraftDraws.at`), and under
    sample-match the target's, from the same seed, so the two draw the same numbers there."""
    return torch.Generator().manual_seed(mix(seed, position))


class DraftDraws:
    """The draft's randomness: `at(position)` is a fresh generator for the token at that position.
    `coupled`: these are the target's own draws (sample-match), so a tree ranks children by them too."""

    def __init__(self, seed: int, coupled: bool = False):
        self.seed, self.coupled = seed, coupled

    def at(self, position: int) -> torch.Generator:
        return position_generator(self.seed, position)


def draft_draws(rng: "DraftDraws | torch.Generator") -> DraftDraws:
    """Drafters take either; a plain generator (tests, one-off calls) gives one seed for the draws."""
    if isinstance(rng, DraftDraws):
        return rng
    if isinstance(rng, torch.Generator):
        return DraftDraws(int(torch.randint(0, 2**62, (), generator=rng)))
    raise TypeError(f"draft randomness must be DraftDraws or torch.Generator, got {type(rng).__name__}")


class Streams:
    """The streams of one generation from its seed."""

    def __init__(self, seed: int, coupled: bool = False):
        """`coupled` (sample-match): every verify gets one seed, from which the target keys its draws by
        position, and the draft draws from that same seed."""
        self.coupled = coupled
        self._positions = mix(seed, 3)
        self.draft = DraftDraws(self._positions, coupled=True) if coupled else DraftDraws(mix(seed, 1))
        self._verify = torch.Generator().manual_seed(mix(seed, 2))

    def verify_seed(self) -> int:
        """The seed a step's verify gets: the generation's own when coupled, else the next of the verify stream."""
        if self.coupled:
            return self._positions
        return int(torch.randint(0, 2**62, (), generator=self._verify))
