"""Tiny random causal LMs built from a config: fast, exact, offline models for tests and protocol benchmarks."""
from __future__ import annotations

import torch

from specbench.models.loaded import LoadedModel
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
    name = f"tiny-random:seed={seed},vocab={vocab_size},hidden={hidden_size},layers={num_layers}"
    if noise_from is not None:
        name += f",noise={noise_scale},noise_from={noise_from.spec.model}"
    return LoadedModel(spec=ModelSpec(model=name, dtype=str(dtype).removeprefix("torch.")), model=model, tokenizer=None)


def tiny_from_name(name: str) -> LoadedModel:
    """Build a tiny model from its name, so workers and CLIs can load one like any other model.

    Example: "tiny-random:seed=1,noise=0.005,noise_from=0" is a noisy copy of "tiny-random:seed=0";
    "tiny-random:seed=0,eos=17" stops generating after token 17.
    """
    from specbench.types import SpecbenchError

    options = dict(seed="0", vocab="96", hidden="64", layers="3")
    body = name.split(":", 1)[1] if ":" in name else ""
    try:
        for part in filter(None, body.split(",")):
            key, value = part.split("=", 1)
            options[key] = value
        base = dict(vocab_size=int(options["vocab"]), hidden_size=int(options["hidden"]),
                    num_layers=int(options["layers"]))
        noise_from = None
        if "noise_from" in options:
            noise_from = tiny_model(seed=int(options["noise_from"]), **base)
        loaded = tiny_model(seed=int(options["seed"]), noise_from=noise_from,
                            noise_scale=float(options.get("noise", 0.0)), **base)
        if "eos" in options:  # tiny models have no EOS of their own; tests give them one by name
            loaded.model.generation_config.eos_token_id = int(options["eos"])
        return loaded
    except (ValueError, KeyError) as error:
        raise SpecbenchError(f"bad tiny model name {name!r} ({error}); e.g. 'tiny-random:seed=0,vocab=96'") from None
