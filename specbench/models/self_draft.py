"""A self-draft: the target's first N decoder layers plus its final norm and head, sharing weights.

Why: it turns a single model (SmolLM2 alone) into a real draft/target pair with no extra memory.
Built by composition of the target's own modules; no third-party class is patched.
"""
from __future__ import annotations

import copy

import torch

from specbench.models.loaded import LoadedModel
from specbench.types import SpecbenchError


def truncated_view(target: LoadedModel, num_layers: int) -> LoadedModel:
    """A causal LM over the first `num_layers` layers of `target` (weights shared, not copied)."""
    model = target.model
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        raise SpecbenchError(
            f"self-draft needs a decoder with model.layers, embed_tokens and norm (Llama/Qwen/Mistral "
            f"style); {type(model).__name__} has another layout")
    if not 1 <= num_layers < len(layers):
        raise SpecbenchError(f"self-draft layers must be in 1..{len(layers) - 1}, got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        shallow = type(model)(config)
    shallow.model.embed_tokens = inner.embed_tokens
    shallow.model.layers = torch.nn.ModuleList(list(layers[:num_layers]))
    shallow.model.norm = inner.norm
    if hasattr(inner, "rotary_emb"):
        shallow.model.rotary_emb = inner.rotary_emb
    shallow.lm_head = model.lm_head
    leftovers = [name for name, tensor in list(shallow.named_parameters()) + list(shallow.named_buffers())
                 if tensor.is_meta]
    if leftovers:
        raise SpecbenchError(f"self-draft view left unshared tensors {leftovers[:3]} for {type(model).__name__}")
    shallow.eval()
    spec = target.spec.with_(model=f"{target.spec.model}[:{num_layers}]")
    return LoadedModel(spec=spec, model=shallow, tokenizer=target.tokenizer)
