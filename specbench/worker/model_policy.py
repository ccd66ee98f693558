"""Which models a worker may load on a client's behalf, and how a loaded model is identified.

Why: `load` is the one request that changes what every other client's verifies compute. A worker
started with `--model` serves that model; anything else must be allow-listed at start, and a name
is matched as a string, never resolved as a path for a remote client (so a refusal says nothing
about which paths exist). The identity (spec + a fingerprint of the weights) travels in every
session reply, so a client notices a different model instead of decoding on with it.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from specbench.models.catalog import CATALOG
from specbench.models.spec import ModelSpec
from specbench.types import SpecbenchError


class LoadRefusedError(SpecbenchError):
    """A load this worker's start-up settings do not allow (answered code "refused")."""


class LoadPolicy:
    def __init__(self, device: str, served: Optional[ModelSpec] = None, draft: Optional[ModelSpec] = None,
                 allowed: Sequence[str] = ()):
        self.device, self.served, self.draft = device, served, draft
        self.allowed = tuple(allowed)

    def check(self, spec: ModelSpec) -> None:
        """Refuse, without touching the file system, what the worker was not started to serve."""
        if spec.gguf_file is not None and ("/" in spec.gguf_file or "\\" in spec.gguf_file
                                           or spec.gguf_file.startswith(".")):
            raise LoadRefusedError(f"gguf_file must be a plain file name inside the model, got {spec.gguf_file!r}")
        if spec.device != self.device:
            raise LoadRefusedError(f"device {spec.device!r} is not this worker's: it serves on {self.device!r}")
        if spec in (self.served, self.draft) or spec.model in self.allowed:
            return
        if self.served is None and _embedded(spec.model) and spec.gguf_file is None:
            return  # a bare worker serves any embedded model: names in the package's own catalog
        serving = f"serves {self.served.label}" if self.served else "was started without --model"
        raise LoadRefusedError(
            f"this worker {serving}; loading {spec.label!r} needs `--allow-load {spec.model}` at worker start")


def _embedded(name: str) -> bool:
    return name in CATALOG or name.startswith("tiny-random")


@torch.inference_mode()
def model_identity(loaded) -> str:
    """`label|dtype|device|fingerprint`: the fingerprint hashes the vocabulary size, parameter count
    and a slice of every parameter, so a different checkpoint under the same name is told apart."""
    model = loaded.model
    digest = hashlib.sha256(f"{loaded.spec.label}|{loaded.vocab_size}".encode())
    for name, parameter in model.named_parameters():
        digest.update(name.encode() + str(tuple(parameter.shape)).encode())
        digest.update(parameter.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
    return f"{loaded.spec.label}|{loaded.spec.dtype}|{loaded.spec.device}|{digest.hexdigest()[:16]}"
