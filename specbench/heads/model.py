"""The draft head: EAGLE-3's shape, one decoder layer over the target's fused features.

Per position t the head reads the token at t + 1 (through the target's embeddings) and a feature of
position t: the target's low, middle and high hidden states fused by `fc` where the target computed
them, the head's own previous output where it is drafting past them. Its output predicts the token at
t + 2. The head keeps its own KV cache, so a step feeds only the new positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from specbench.heads.config import HeadConfig


@dataclass
class HeadCache:
    """The head's keys and values per position, [kv heads, positions, head dim]; `keep` drops the tail."""

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    length: int = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=1)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=1)
        self.length = self.keys.shape[1]
        return self.keys, self.values

    def keep(self, length: int) -> None:
        if self.keys is not None and length < self.length:
            self.keys, self.values = self.keys[:, :length], self.values[:, :length]
            self.length = length


def _llama_config(config: HeadConfig):
    from transformers import LlamaConfig

    extra = {key: value for key, value in config.extra.items() if key in ("rope_scaling", "hidden_act")}
    return LlamaConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                       num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                       head_dim=config.dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                       max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size, **extra)


class _Attention(nn.Module):
    """Attention whose queries, keys and values read [embedding, feature]: twice the hidden size."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        width, dim = 2 * config.hidden_size, config.dim
        self.heads, self.kv_heads, self.dim = config.num_attention_heads, config.num_key_value_heads, dim
        self.q_proj = nn.Linear(width, self.heads * dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(self.heads * dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rotary, cache: HeadCache, visible: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        count = x.shape[0]
        q = self.q_proj(x).view(count, self.heads, self.dim).transpose(0, 1)
        k = self.k_proj(x).view(count, self.kv_heads, self.dim).transpose(0, 1)
        v = self.v_proj(x).view(count, self.kv_heads, self.dim).transpose(0, 1)
        cos, sin = rotary
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        keys, values = cache.append(k[0], v)
        group = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        out = nn.functional.scaled_dot_product_attention(q[0], keys, values, attn_mask=visible)
        return self.o_proj(out.transpose(0, 1).reshape(count, self.heads * self.dim))


class _Layer(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        llama = _llama_config(config)
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = _Attention(config)
        self.mlp = LlamaMLP(llama)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, embeds, features, rotary, cache, visible):
        if self.norm_before_residual:
            features = self.hidden_norm(features)
            residual = features
        else:
            residual, features = features, self.hidden_norm(features)
        x = torch.cat([self.input_layernorm(embeds), features], dim=-1)
        hidden = residual + self.self_attn(x, rotary, cache, visible)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    """EAGLE-3's draft head. `embed_tokens` is the target's input embedding unless the checkpoint has
    its own; `d2t[i]` is the offset from draft id i to its target id (target = i + d2t[i])."""

    def __init__(self, config: HeadConfig, embed_tokens: Optional[nn.Module] = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.config = config
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(config.vocab_size,
                                                                                       config.hidden_size)
        self.fc = nn.Linear(config.feature_width, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([_Layer(config)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(_llama_config(config))

    @property
    def draft_to_target(self) -> torch.Tensor:
        """The target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocabulary(self, target_ids) -> None:
        """Make draft id i stand for target id `target_ids[i]` (ascending, as EAGLE-3's d2t assumes)."""
        ids = torch.as_tensor(sorted(int(i) for i in target_ids), dtype=torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, raw: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer inputs [positions, layers x its hidden] -> the head's feature."""
        return self.fc(raw.to(self.fc.weight.dtype))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
                visible: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's output before its final norm [T, hidden], draft-vocabulary logits [T, draft vocab])
        for T new positions after `cache`; `visible` [T, cached + T] which positions each may see
        (default: every cached one and the new ones causally; a tree passes its ancestors)."""
        count, past = tokens.shape[0], cache.length
        if visible is None:
            visible = torch.ones(count, past + count, dtype=torch.bool, device=tokens.device).tril(past)
        embeds = self.embed_tokens(tokens).to(features.dtype)
        rotary = self.rotary(features[None], positions[None])
        hidden = self.layers[0](embeds, features, rotary, cache, visible)
        return hidden, self.lm_head(self.norm(hidden))
