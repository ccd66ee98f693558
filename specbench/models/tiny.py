"""Tiny random causal LMs built from a config: fast, exact, offline models for tests and protocol benchmarks."""
from __future__ import annotations

import torch

from specbench.models.loading import LoadedModel
from specbench.models.spec import ModelSpec


def tiny_model(seed: int = 0, vocab_size: int = 96, hidden_size: int = 64, num_layers: int = 3,
               noise_from: LoadedModel | None = None, noise_scale: float = 0.0,
               dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A random Llama with peaked logits (large init) so greedy choices are rarely near-ties.

    With `noise_from`, the model is a copy of that one with Gaussian noise of `noise_scale`
    added to every weight: a correlated draft whose acceptance is neither 0 nor 1.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    if noise_from is not None:
        model.load_state_dict(noise_from.model.state_dict())
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise_scale * torch.randn(parameter.shape, generator=generator).to(dtype))
    spec = ModelSpec(model=f"tiny-random-{seed}-v{vocab_size}-h{hidden_size}-l{num_layers}")
    return LoadedModel(spec=spec, model=model, tokenizer=None)
