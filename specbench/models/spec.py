"""What to load: a model id or path, its dtype, device and quantization, as one typed value."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specbench.types import SpecbenchError

QUANTIZATIONS = ("none", "8bit", "4bit", "int8-dynamic")  # bitsandbytes 8bit/4bit, PyTorch int8-dynamic (CPU)
DTYPES = ("float32", "bfloat16", "float16")
# "onednn": large linear layers on oneDNN (`models/cpu_kernels.py`); "tuned": per row count the fastest of
# equal products, measured at load (`models/tuned_linear.py`)
KERNELS = ("default", "onednn", "tuned")
KERNELS_HELP = ("CPU linear kernels: onednn (large float32 layers on oneDNN) or tuned (per row count the fastest "
                "product form, measured at load): faster at the few rows SD verifies")


@dataclass(frozen=True)
class ModelSpec:
    """A model to load.

    `model` is an embedded catalog name (see `specbench.models.catalog.CATALOG`), a Hugging Face
    model id, or a local directory; `gguf_file` names a GGUF file inside that id or directory.
    """

    model: str
    gguf_file: Optional[str] = None
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"
    kernels: str = "default"

    def __post_init__(self):
        if not self.model:
            raise SpecbenchError("ModelSpec.model is empty: give a catalog name, a Hugging Face id or a path")
        if self.quantization not in QUANTIZATIONS:
            raise SpecbenchError(
                f"unknown quantization {self.quantization!r}; choose one of {QUANTIZATIONS}")
        if self.dtype not in DTYPES:
            raise SpecbenchError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.kernels not in KERNELS:
            raise SpecbenchError(f"unknown kernels {self.kernels!r}; choose one of {KERNELS}")

    def with_(self, **changes) -> "ModelSpec":
        fields = {**self.__dict__, **changes}
        return ModelSpec(**fields)

    def quantized(self, quantization: str) -> "ModelSpec":
        """The same weights at `quantization` (a substitute draft's): PyTorch's dynamic int8 quantizes float32
        Linear layers, so int8-dynamic loads them in float32 whatever this spec's dtype; quantized layers keep
        their own kernels."""
        return self.with_(quantization=quantization, kernels="default",
                          **({"dtype": "float32"} if quantization == "int8-dynamic" else {}))

    @property
    def label(self) -> str:
        quant = "" if self.quantization == "none" else f"@{self.quantization}"
        kernels = "" if self.kernels == "default" else f"+{self.kernels}"
        return f"{self.model}{quant}{kernels}"


def label_model(label: str) -> str:
    """The model a `ModelSpec.label` names, less its "@quantization" and "+kernels" (a worker reports its label;
    `--target` names the model)."""
    return label.split("@")[0].split("+")[0]


def acceptance_label(label: str) -> str:
    """The label a model's acceptance is recorded under: kernels change speed, not which tokens win,
    so "qwen2.5-coder-1.5b+onednn" accepts what "qwen2.5-coder-1.5b" does."""
    for kernels in KERNELS:
        label = label.removesuffix(f"+{kernels}")
    return label
