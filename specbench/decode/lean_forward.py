"""A Llama / Mistral / Qwen2 / Qwen3 decoder forward in fewer kernels, for the fast path's fixed-shape steps.

Why: graph-captured on an H100, Hugging Face's Qwen2.5-1.5B forward of one token ran 4.65 ms against a
1.10 ms memory floor. Capture removes the launches' CPU cost, not the device's cost of each of the ~40
small kernels per layer (its RMSNorm alone is six: an upcast, pow, mean, add, rsqrt, two multiplies).
This forward computes the same function with about half as many: one matmul for q, k and v and one for
gate and up (their weights concatenated once, the modules' own weights becoming views of the result, so
no memory is added and Hugging Face's forward still reads the same values), a fused `rms_norm`, rotary
applied to q and k in one go, each residual add folded into its output projection (`addmm`), and
grouped-query attention without copying the keys per head: the query heads that share a key head are
stacked as extra query rows of that head (the mask repeated to match, once per step), as Hugging Face does
for one token without a mask; with a mask, PyTorch's own grouped attention falls back to its slowest
kernel on CUDA, and Hugging Face's copies every key and value per head instead.

It runs over the fast path's caches (`StaticKV`, `PoolBatch`), whose layers take the new keys and values
and return what to attend over, and takes the additive 4D mask and positions `FastForward` builds. Only
models `supports` accepts: Llama, Mistral, Qwen2 and Qwen3 layers of plain `nn.Linear` weights; others keep
Hugging Face's forward. In float32 the results equal Hugging Face's up to float rounding (the greedy tests hold
token for token); in bfloat16 the fused RMSNorm rounds once where Hugging Face rounds twice.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from specbench.decode.kv import plain_layers

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # one decoder layout; Qwen3 adds per-head q/k norms


def supports(model) -> bool:
    """Whether `model` is a decoder this forward computes exactly: Llama, Mistral, Qwen2 or Qwen3 layers, full
    attention, unquantized `nn.Linear` projections, q/k/v (gate/up) all biased or none."""
    config = model.config
    if config.model_type not in MODEL_TYPES or not plain_layers(config):
        return False
    if getattr(model, "hf_quantizer", None) is not None or getattr(config, "pretraining_tp", 1) != 1:
        return False
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(linear) is not torch.nn.Linear for linear in linears):
            return False
        if hasattr(attention, "q_norm") != (config.model_type == "qwen3"):
            return False
        for fused in (linears[:3], linears[4:6]):  # biases all or none, as the fused matmul has one or none
            if len({linear.bias is None for linear in fused}) > 1:
                return False
    return True


def _fused(linears: list, name: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One weight (and bias) for `linears`, whose own parameters become row views of it: done once per
    model (a second call finds the views in place and returns the same tensors)."""
    owner = linears[0]
    held = getattr(owner, name, None)
    rows = [linear.weight.shape[0] for linear in linears]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    if held is not None and all(linear.weight.data_ptr() == held[0][start:].data_ptr()
                                for linear, start in zip(linears, starts)):
        return held
    with torch.no_grad():
        weight = torch.cat([linear.weight.data for linear in linears])
        bias = torch.cat([linear.bias.data for linear in linears]) if owner.bias is not None else None
        for linear, start, count in zip(linears, starts, rows):
            linear.weight.data = weight[start:start + count]
            if linear.bias is not None:
                linear.bias.data = bias[start:start + count]
    setattr(owner, name, (weight, bias))
    return weight, bias


class _Layer:
    """One decoder layer's tensors, read once."""

    def __init__(self, layer):
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv, self.qkv_bias = _fused([attention.q_proj, attention.k_proj, attention.v_proj], "_specbench_qkv")
        self.gate_up, self.gate_up_bias = _fused([mlp.gate_proj, mlp.up_proj], "_specbench_gate_up")
        self.out, self.out_bias = attention.o_proj.weight, attention.o_proj.bias
        self.down, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias
        self.norm_in, self.eps_in = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm_post = layer.post_attention_layernorm.weight
        self.eps_post = layer.post_attention_layernorm.variance_epsilon
        self.heads = attention.q_proj.weight.shape[0] // attention.head_dim
        self.kv_heads = attention.k_proj.weight.shape[0] // attention.head_dim
        self.head_dim, self.scaling, self.act = attention.head_dim, attention.scaling, mlp.act_fn
        self.inter = mlp.gate_proj.weight.shape[0]
        # Qwen3: per-head RMSNorms of queries and keys (`supports` checks that only Qwen3 has them)
        self.q_norm, self.k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)


class LeanForward:
    """`model`'s forward over a fast-path cache: logits [rows, n or len(keep), vocab]."""

    def __init__(self, model):
        self.model = model
        self.layers = [_Layer(layer) for layer in model.model.layers]
        self.norm, self.eps = model.model.norm.weight, model.model.norm.variance_epsilon

    def __call__(self, cache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 keep=0) -> torch.Tensor:
        """`input_ids`, `position_ids` [rows, n]; `mask` [rows, 1, n, width] additive; `keep`: 0 for every
        position's logits, or a tensor of the positions the head reads. Call under `torch.inference_mode()`
        (as `FastForward` does) or `no_grad`."""
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [rows, 1, n, head_dim]: broadcast over heads
        group = self.layers[0].heads // self.layers[0].kv_heads
        grouped = mask.repeat(1, 1, group, 1) if group > 1 else mask  # one mask row per stacked query row
        for layer, cache_layer in zip(self.layers, cache.layers):
            hidden = _decoder_layer(layer, hidden, cos, sin, grouped, cache_layer)
        hidden = _rms_norm(hidden, self.norm, self.eps)
        if not isinstance(keep, int):
            hidden = hidden[:, keep]
        elif keep:
            hidden = hidden[:, -keep:]
        return self.model.lm_head(hidden)


def _decoder_layer(layer: _Layer, hidden: torch.Tensor, cos, sin, grouped_mask, cache_layer) -> torch.Tensor:
    """One layer; `grouped_mask` [rows, 1, group * n, width]: the step's mask once per query head sharing a
    key head (query row r * n + t is head kv * group + r at position t)."""
    rows, n, size = hidden.shape
    heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
    qkv = F.linear(_rms_norm(hidden, layer.norm_in, layer.eps_in), layer.qkv, layer.qkv_bias)
    qkv = qkv.view(rows, n, heads + 2 * kv_heads, head_dim)
    qk, values = qkv[:, :, :heads + kv_heads], qkv[:, :, heads + kv_heads:].transpose(1, 2)
    if layer.q_norm is not None:  # each head's query and key normalized over head_dim before rotary
        qk = torch.cat((_rms_norm(qk[:, :, :heads], layer.q_norm.weight, layer.q_norm.variance_epsilon),
                        _rms_norm(qk[:, :, heads:], layer.k_norm.weight, layer.k_norm.variance_epsilon)), dim=2)
    qk = qk.transpose(1, 2)  # [rows, heads + kv_heads, n, head_dim]
    half = head_dim // 2
    qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin  # rotary, q and k together
    keys, values = cache_layer.update(qk[:, heads:], values)
    queries = qk[:, :heads].reshape(rows, kv_heads, (heads // kv_heads) * n, head_dim)
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=grouped_mask, scale=layer.scaling)
    # reshape, not view: on CUDA some attention kernels (fp32's memory-efficient one) return a layout whose
    # kv-head and query-row dimensions cannot be merged without a copy
    attended = attended.reshape(rows, heads, n, head_dim).transpose(1, 2).reshape(rows * n, heads * head_dim)
    flat = _residual_linear(hidden.reshape(rows * n, size), attended, layer.out, layer.out_bias)
    gate, up = F.linear(_rms_norm(flat, layer.norm_post, layer.eps_post), layer.gate_up,
                        layer.gate_up_bias).split(layer.inter, dim=-1)
    flat = _residual_linear(flat, layer.act(gate) * up, layer.down, layer.down_bias)
    return flat.view(rows, n, size)


def _residual_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """residual + x @ weight.T (+ bias), the add inside the matmul's kernel."""
    out = torch.addmm(residual, x, weight.t())
    return out + bias if bias is not None else out


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)
