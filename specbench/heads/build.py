"""A new head for a target: sized like the target's own layers, its draft vocabulary chosen by the caller
(e.g. the most frequent ids of a corpus, `train-draft`), random weights until trained."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specbench.heads.config import HeadConfig, default_layer_ids
from specbench.heads.model import EagleHead


def new_head(target, draft_ids: Optional[Sequence[int]] = None, layer_ids: Optional[Sequence[int]] = None,
             seed: int = 0) -> EagleHead:
    """A head for `target` (a LoadedModel) that shares its embeddings; `draft_ids`: the target ids it
    may propose (default: all)."""
    config = target.model.config
    layers = config.num_hidden_layers
    head_config = HeadConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        vocab_size=target.vocab_size, draft_vocab_size=len(draft_ids) if draft_ids is not None else target.vocab_size,
        target_hidden_size=config.hidden_size, layer_ids=tuple(layer_ids or default_layer_ids(layers)),
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0)),
        head_dim=getattr(config, "head_dim", None), max_position_embeddings=config.max_position_embeddings)
    torch.manual_seed(seed)
    head = EagleHead(head_config, embed_tokens=target.model.get_input_embeddings())
    head.shares_embeddings = True
    head.set_vocabulary(range(target.vocab_size) if draft_ids is None else draft_ids)
    parameter = target.model.get_input_embeddings().weight
    return head.to(parameter.dtype).to(parameter.device).eval()
