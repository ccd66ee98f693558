"""A loaded model: the spec it came from, the transformers model and its tokenizer (if any)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from specbench.models.spec import ModelSpec


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Optional[Any]  # None for tiny random test models that have no tokenizer

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: every id in [0, vocab_size) has a logit."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)
