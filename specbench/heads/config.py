"""What a draft head is: its sizes, the target layers it reads, and its draft vocabulary.

Why one dataclass: the two published layouts (EAGLE-3's own, as vLLM and SGLang read it, and vLLM's
speculators) spell the same numbers differently; both are read into this and written from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specbench.types import SpecbenchError


def default_layer_ids(target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high feature: the inputs of layers 2, L/2 and L-3 (clamped to the target)."""
    clamp = lambda i: min(max(i, 0), target_layers - 1)  # noqa: E731
    return clamp(2), clamp(target_layers // 2), clamp(target_layers - 3)


def check_layer_ids(ids, target_layers: int, what: str) -> None:
    """Refuse, by name, layer ids a target of `target_layers` layers does not have. Id `target_layers`
    itself is the target's final hidden state (its last norm's output, what its LM head reads)."""
    bad = [i for i in ids if not 0 <= i <= target_layers]
    if bad:
        raise SpecbenchError(f"{what} {list(ids)}, but the target has {target_layers} layers (ids {bad} do not "
                             f"exist; {target_layers} is its final hidden state)")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's: what token ids mean
    draft_vocab_size: int  # the head's output rows, mapped to target ids by d2t
    target_hidden_size: Optional[int] = None  # None: the head's own hidden size
    layer_ids: tuple[int, ...] = ()  # the target layers whose inputs are fused (empty: default_layer_ids; L: final)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: Optional[int] = None
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    fc_bias: bool = False
    extra: dict = field(default_factory=dict)  # the published config's other fields, written back as read

    @property
    def features_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def feature_width(self) -> int:
        """Width of one position's fused input (the read layers' hidden states side by side): `fc`'s input, and
        a feature row on the wire; three layers until `fitted` names them (EAGLE-3's default)."""
        return len(self.layer_ids or (0, 0, 0)) * self.features_size

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def fitted(self, target_layers: int) -> "HeadConfig":
        """This config with its layer ids filled in for a target of `target_layers` layers."""
        from dataclasses import replace

        ids = tuple(self.layer_ids) or default_layer_ids(target_layers)
        check_layer_ids(ids, target_layers, "draft head reads target layers")
        return replace(self, layer_ids=ids)
