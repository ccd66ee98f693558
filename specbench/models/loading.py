"""ModelSpec -> (model, tokenizer), with quantization and clear refusals instead of tracebacks."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Union

import torch

from specbench.models.catalog import CATALOG, ensure_model
from specbench.models.hub import hub_kwargs, offline_reason
from specbench.models.loaded import LoadedModel
from specbench.models.spec import ModelSpec
from specbench.types import SpecbenchError


class QuantizationUnavailableError(SpecbenchError):
    """bitsandbytes quantization was asked for where it cannot run."""


class ModelTooLargeError(SpecbenchError):
    """The model would not fit in the memory left on the device."""


class VocabMismatchError(SpecbenchError):
    """Draft and target tokenizers disagree on what token ids mean."""


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _resolve_source(spec: ModelSpec) -> tuple[str, dict]:
    if spec.model in CATALOG:
        return str(ensure_model(spec.model)), {}
    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    if not Path(spec.model).expanduser().exists():  # a hub id: from the cache alone where the hub is out of reach
        kwargs.update(hub_kwargs())
    return spec.model, kwargs


def _quantization_config(spec: ModelSpec):
    """transformers' config for bitsandbytes; None when loading unquantized (or quantizing after load)."""
    if spec.quantization in ("none", "int8-dynamic"):
        return None
    # On CPUs with AVX-512 bf16, bitsandbytes' import tries to fetch an optional 4-bit kernel from the Hugging Face
    # hub and, when it cannot, warns "Failed to load ... pip install kernels" and uses its own bundled kernel: a
    # warning a user can do nothing about (and wrong where the hub is out of reach), so it is kept from the run.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401  (import proves the backend is usable here)
        from transformers import BitsAndBytesConfig
    except Exception as error:  # bitsandbytes raises various errors when no backend fits
        raise QuantizationUnavailableError(
            f"{spec.quantization} quantization needs bitsandbytes, which failed to import here "
            f"({error}). Use quantization='none', or install bitsandbytes>=0.45 (CPU and CUDA builds).") from None
    compute = _torch_dtype(spec.dtype)
    # bitsandbytes logs on every 8-bit matmul that inputs are cast to fp16: thousands of lines a run.
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    if spec.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute, bnb_4bit_quant_type="nf4")


def _check_dynamic_int8(spec: ModelSpec) -> None:
    """PyTorch's dynamic int8 Linear has CPU kernels only, for float32 models."""
    if spec.quantization != "int8-dynamic":
        return
    if spec.device != "cpu":
        raise QuantizationUnavailableError(
            f"int8-dynamic runs on the CPU only (PyTorch's x86/fbgemm kernels), not on {spec.device}; "
            f"on {spec.device} use quantization='8bit' or '4bit' (bitsandbytes)")
    if spec.dtype != "float32":
        raise QuantizationUnavailableError(
            f"int8-dynamic quantizes float32 Linear layers; load with dtype='float32', not {spec.dtype}")
    if not hasattr(torch, "ao") or not hasattr(torch.ao.quantization, "quantize_dynamic") or \
            not torch.backends.quantized.supported_engines:
        raise QuantizationUnavailableError(
            f"this PyTorch ({torch.__version__}) has no dynamic int8 quantization; use '8bit' or '4bit' (bitsandbytes)")


def _quantize_dynamic_int8(model):
    """Every Linear (output layer included) to int8 weights with int8 matmuls on the CPU."""
    import warnings

    with warnings.catch_warnings():  # torch.ao's deprecation notice; still shipped and measured here
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def available_bytes(device: str) -> Optional[int]:
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    if device == "cpu":
        try:
            with open("/proc/meminfo") as info:
                for line in info:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def _estimated_bytes(source: str, spec: ModelSpec) -> Optional[int]:
    """Parameter bytes from a local config, for refusing a load that cannot fit; None if unknown."""
    config_path = Path(source) / "config.json"
    weights = list(Path(source).glob("*.safetensors")) if Path(source).is_dir() else []
    if not weights or not config_path.exists():
        return None
    stored = json.loads(config_path.read_text()).get("dtype") or json.loads(config_path.read_text()).get("torch_dtype")
    stored_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(stored, 2)
    on_disk = sum(path.stat().st_size for path in weights)
    wanted = {"float32": 4, "bfloat16": 2, "float16": 2}[spec.dtype]
    if spec.quantization in ("8bit", "int8-dynamic"):
        wanted = 1
    elif spec.quantization == "4bit":
        wanted = 0.5
    return int(on_disk / stored_bytes * wanted)


def load_model(spec: ModelSpec) -> LoadedModel:
    """Load a causal LM and its tokenizer as `spec` says; refuse loads that cannot work, by name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_dynamic_int8(spec)
    if spec.kernels == "onednn":
        from specbench.models.cpu_kernels import check_onednn

        check_onednn(spec.device, spec.dtype, spec.quantization)
    if spec.kernels == "tuned":
        from specbench.models.tuned_linear import check_tuned

        check_tuned(spec.device, spec.dtype, spec.quantization)
    if spec.model.startswith("tiny-random"):
        from specbench.models.tiny import tiny_from_name

        loaded = tiny_from_name(spec.model)
        loaded.model.to(dtype=_torch_dtype(spec.dtype), device=spec.device)
        if spec.quantization == "int8-dynamic":
            loaded.model = _quantize_dynamic_int8(loaded.model)
        loaded.spec = spec
        return _with_kernels(loaded)
    source, extra = _resolve_source(spec)
    quantization = _quantization_config(spec)
    needed, available = _estimated_bytes(source, spec), available_bytes(spec.device)
    if needed is not None and available is not None and needed > 0.9 * available:
        raise ModelTooLargeError(
            f"{spec.label} needs about {needed / 2**30:.1f} GiB on {spec.device} but only "
            f"{available / 2**30:.1f} GiB is free; try quantization='8bit' or '4bit', or a smaller dtype")
    kwargs = dict(extra, dtype=_torch_dtype(spec.dtype))
    if quantization is not None:
        kwargs.update(quantization_config=quantization, device_map=spec.device)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except torch.OutOfMemoryError as error:
        raise ModelTooLargeError(f"{spec.label} ran out of memory while loading on {spec.device}: {error}") from None
    except OSError as error:
        why = str(error)
        if extra.get("local_files_only"):  # transformers' own words would tell the user to check the connection
            why = f"{offline_reason()}: {why.splitlines()[0][:160]}"
        raise SpecbenchError(
            f"could not load {spec.model!r}: {why.rstrip('.')}. Give an embedded name {sorted(CATALOG)}, "
            f"a local directory, or a Hugging Face id (needs the hub).") from None
    if quantization is None:
        model.to(spec.device)
    if spec.quantization == "int8-dynamic":
        model = _quantize_dynamic_int8(model)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    return _with_kernels(LoadedModel(spec=spec, model=model, tokenizer=tokenizer))


def _with_kernels(loaded: LoadedModel) -> LoadedModel:
    if loaded.spec.kernels == "onednn":
        from specbench.models.cpu_kernels import use_onednn

        use_onednn(loaded.model)
    elif loaded.spec.kernels == "tuned":
        from specbench.models.tuned_linear import use_tuned

        use_tuned(loaded.model)
    return loaded


def load_tokenizer(model: Union[str, ModelSpec]):
    """Only the tokenizer (None for tiny random models): what a client of a remote target needs for text."""
    from transformers import AutoTokenizer

    spec = model if isinstance(model, ModelSpec) else ModelSpec(model=model)
    if spec.model.startswith("tiny-random"):
        return None
    source, extra = _resolve_source(spec)
    return AutoTokenizer.from_pretrained(source, **extra)


def as_loaded(model: Union[str, ModelSpec, LoadedModel], dtype: str = "float32") -> LoadedModel:
    """A catalog name, Hugging Face id, path or ModelSpec, loaded; a LoadedModel as it is."""
    if isinstance(model, LoadedModel):
        return model
    return load_model(model if isinstance(model, ModelSpec) else ModelSpec(model=model, dtype=dtype))


def check_vocab_compatible(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a draft whose token ids mean something else to the target (both loaded here)."""
    same_vocabulary(draft, target, target.tokenizer, target.vocab_size)


def same_vocabulary(draft: LoadedModel, target: Optional[LoadedModel], target_tokenizer, target_vocab_size: int) -> None:
    """Raise VocabMismatchError unless the draft's ids mean the target's tokens.

    Allowed: identical vocabularies, and the padding case where one tokenizer's vocabulary is a
    prefix of the other's (models often pad the embedding to a multiple of 64 or 128). Without
    both tokenizers only the output sizes can be compared. `target` is None for a remote target.
    """
    if draft.tokenizer is None or target_tokenizer is None:
        if draft.vocab_size != target_vocab_size and (target is not None or draft.vocab_size < target_vocab_size):
            raise VocabMismatchError(
                f"draft has {draft.vocab_size} output ids but target has {target_vocab_size}, and "
                f"no tokenizer is there to show they agree")
        return
    draft_vocab, target_vocab = draft.tokenizer.get_vocab(), target_tokenizer.get_vocab()
    small, large = sorted((draft_vocab, target_vocab), key=len)
    disagreeing = [token for token, index in small.items() if large.get(token) != index]
    if disagreeing:
        target_label = target.spec.label if target is not None else "the target"
        raise VocabMismatchError(
            f"draft {draft.spec.label} and target {target_label} tokenizers differ on "
            f"{len(disagreeing)} tokens (e.g. {disagreeing[:3]})")
