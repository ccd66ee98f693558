"""The target's features a head drafts from: the inputs of a few of its decoder layers, per position.

Why hooks: the target's verify forward already computes every layer's input; a pre-forward hook on the
chosen layers keeps them, so the head never runs a second target forward. A target with a tap keeps
the rows of the committed positions of the sessions a head drafts for (`LocalTarget.keep_features`),
in a lone forward or a batch of several sessions (`decode/batch.py`).
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from specbench.types import SpecbenchError


def decoder_layers(model) -> Sequence[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise SpecbenchError(f"a draft head reads the target's decoder layers (model.layers), and "
                             f"{type(model).__name__} has none that specbench can find")
    return layers


class FeatureTap:
    """Keeps the input of layers `layer_ids` of `model` on every forward (batch 1), for `rows`; id L (the
    layer count) keeps the final norm's output, as `output_hidden_states` reports it last."""

    def __init__(self, model, layer_ids: Sequence[int]):
        layers = decoder_layers(model)
        self.layer_ids = tuple(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_pre_hook(partial(self._keep, i), with_kwargs=True)
                        for i in self.layer_ids if i < len(layers)]
        if len(layers) in self.layer_ids:
            norm = getattr(model.model, "norm", None)
            if norm is None:
                raise SpecbenchError(f"a draft head reading layer {len(layers)} (the final hidden state) taps the "
                                     f"target's final norm (model.norm), and {type(model).__name__} has none")
            self.handles.append(norm.register_forward_hook(partial(self._keep_output, len(layers))))

    def _keep(self, index: int, module, args, kwargs) -> None:
        self.captured[index] = args[0] if args else kwargs["hidden_states"]

    def _keep_output(self, index: int, module, args, output) -> None:
        self.captured[index] = output

    def joined(self) -> torch.Tensor:
        """The last forward's features, [batch, inputs, layers x hidden]; read once."""
        if len(self.captured) != len(set(self.layer_ids)):
            raise SpecbenchError("the target's last forward left no features for the draft head (a forward "
                                 "that bypassed its layers, e.g. a captured graph)")
        joined = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return joined

    def rows(self, positions: Sequence[int]) -> list[torch.Tensor]:
        """The last (batch-1) forward's features at `positions` of its inputs: one [layers x hidden] row each."""
        return list(self.joined()[0, list(positions)].unbind(0))


def attach(target, layer_ids: Sequence[int]) -> FeatureTap:
    """`target`'s tap on `layer_ids` (a LocalTarget). One tap per model, kept on it: every target over
    the same weights shares it, so running a head again adds no second set of hooks."""
    if getattr(target, "fast", None) is not None:
        raise SpecbenchError("a draft head needs the target's hidden states, which the fast path's fixed-shape "
                             "forwards do not expose: run the target with fast=False")
    tap = getattr(target.model, "_specbench_feature_tap", None)
    if tap is not None and tap.layer_ids != tuple(layer_ids):
        raise SpecbenchError(f"this target model already feeds a head from layers {list(tap.layer_ids)}; a head "
                             f"reading layers {list(layer_ids)} needs a model of its own")
    if tap is None:
        tap = FeatureTap(target.model, layer_ids)
        target.model._specbench_feature_tap = tap
    target.tap = tap
    return tap
