"""A loaded model: the spec it came from, the transformers model and its tokenizer (if any)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from specbench.models.memory import kv_bytes_per_token, weight_bytes
from specbench.models.spec import ModelSpec


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Optional[Any]  # None for tiny random test models that have no tokenizer

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: every id in [0, vocab_size) has a logit."""
        head = self.model.get_output_embeddings()
        if hasattr(head, "out_features"):  # also quantized layers, whose weight is packed or a method
            return int(head.out_features)
        return int(head.weight.shape[0])

    @cached_property
    def weight_bytes(self) -> int:
        """Bytes its weights take as loaded (quantized ones as stored)."""
        return weight_bytes(self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)
