"""oneDNN linear layers for models on a CPU: the same products, a kernel that is fast at SD's shapes.

Why: on the 2-vCPU AMD EPYC box (no AVX-512) PyTorch's default fp32 matmul is poor at the few rows a
verify or a batch of verifies has: [5, 1536] x [1536, 8960] takes 7.3 ms, 3.2x one row's 2.3 ms,
where oneDNN takes 3.4 ms (1.6 ms for one row). That ratio decides whether SD pays on a CPU target at
all. Only large layers change (at least `MIN_WEIGHTS` weights: the MLPs and language-model head of
the Qwen models, SmolLM2's head): on small ones oneDNN's fixed cost loses (576 x 576, one row: 0.13 ms
against 0.04 ms). `benchmarks/cpu_kernels.py` measures whole forwards both ways.

Cost: a language-model head tied to the input embedding gets its own copy (the embedding keeps the
plain one), vocab x hidden x 4 bytes more (SmolLM2 113 MB, Qwen2.5 1.5B 934 MB); counted in
`weight_bytes`.
"""
from __future__ import annotations

import torch
from torch import nn

from specbench.types import SpecbenchError

MIN_WEIGHTS = 2**22  # in_features x out_features of the smallest layer converted


class OneDNNLinear(nn.Module):
    """A float32 `nn.Linear` whose weight is held as a oneDNN tensor; inputs and outputs stay plain."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to_mkldnn())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to_mkldnn())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        return torch.ops.aten.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight, self.bias).to_dense()


def check_onednn(device: str, dtype: str, quantization: str) -> None:
    """Refuse, naming why, a load that asks for oneDNN kernels where they cannot run."""
    if not torch.backends.mkldnn.is_available():
        raise SpecbenchError(f"kernels='onednn' needs a PyTorch built with oneDNN; this one ({torch.__version__}) "
                             f"has none: use kernels='default'")
    check_plain_cpu_layers("onednn", device, quantization)
    if dtype != "float32":
        raise SpecbenchError(f"kernels='onednn' converts float32 layers; load with dtype='float32', not {dtype!r}")


def check_plain_cpu_layers(kernels: str, device: str, quantization: str) -> None:
    """Refuse, naming why, CPU kernels (`onednn`, `tuned`) for a model off the CPU or with quantized layers."""
    if device != "cpu":
        raise SpecbenchError(f"kernels={kernels!r} is for models on the CPU, not {device!r}: use kernels='default'")
    if quantization != "none":
        raise SpecbenchError(f"kernels={kernels!r} converts unquantized layers; {quantization!r} layers keep their "
                             f"own kernels: use kernels='default' with quantization={quantization!r}")


def onednn_usable(device: str, dtype: str, quantization: str) -> bool:
    """Whether `kernels='onednn'` can run for such a load (`check_onednn` says why not)."""
    try:
        check_onednn(device, dtype, quantization)
    except SpecbenchError:
        return False
    return True


def use_onednn(model: nn.Module, min_weights: int = MIN_WEIGHTS) -> int:
    """Replace, in place, every plain float32 `nn.Linear` of at least `min_weights` weights by a
    `OneDNNLinear`; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype == torch.float32
                    and child.in_features * child.out_features >= min_weights):
                setattr(parent, name, OneDNNLinear(child))
                replaced += 1
    return replaced
