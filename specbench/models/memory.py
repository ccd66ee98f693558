"""What a loaded model holds in memory: its weight bytes as stored (quantized or not) and its KV bytes per token.

Why measured from the loaded object and not from parameter counts: quantized layers keep their
weights in packed buffers, scales and tensor subclasses that `parameters()` misses or miscounts,
and a tied embedding/output layer must be counted once (or twice, when quantizing unties it).
"""
from __future__ import annotations

import torch


def weight_bytes(model) -> int:
    """Bytes of every tensor in the state dict, each storage counted once."""
    seen: set = set()
    return sum(_tensor_bytes(value, seen) for value in model.state_dict().values())


def _tensor_bytes(value, seen: set) -> int:
    if isinstance(value, (tuple, list)):  # PyTorch's dynamic int8 Linear keeps (weight, bias) packed
        return sum(_tensor_bytes(item, seen) for item in value)
    if not isinstance(value, torch.Tensor):
        return 0
    if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()  # tensor subclasses (torchao) hold their data inside
        return sum(_tensor_bytes(getattr(value, name), seen) for name in names)
    if value.is_mkldnn:  # oneDNN layers (`cpu_kernels`): an opaque tensor of its own
        key = ("mkldnn", id(value))
        size = value.numel() * value.element_size()
    elif value.is_quantized:
        key = ("quantized", value.data_ptr())
        size = value.numel() * value.element_size()
    else:
        key = value.untyped_storage().data_ptr()
        size = value.untyped_storage().nbytes()
    if key in seen:
        return 0
    seen.add(key)
    return size


def kv_bytes_per_token(model) -> int:
    """Keys and values one token adds to the cache: layers x 2 x KV heads x head size x element bytes."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
    return int(config.num_hidden_layers * 2 * heads * head_dim * element)
