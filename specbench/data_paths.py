"""Where the shipped data folders are (`profiles/`, `reference/` and `datasets/`), and the user's own.

Why not a path relative to this file: from a wheel the package lives in site-packages while the
folders are installed as data files under `<prefix>/share/specbench/`. Lookup order: an environment
variable (`SPECBENCH_PROFILES`, `SPECBENCH_REFERENCE`, `SPECBENCH_DATASETS`, or `SPECBENCH_DATA`
for all three), the source checkout, the installed data files. A user's own measurements (notebook
05, `specbench profile --own`) go to the user cache (`user_folder`), never into the shipped folders.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

FOLDERS = ("profiles", "reference", "datasets")


def cache_root() -> Path:
    """User cache for models, datasets and own measurements; `SPECBENCH_CACHE` overrides (CI caches it)."""
    override = os.environ.get("SPECBENCH_CACHE")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specbench"


def user_folder(name: str) -> Path:
    """The user's own `profiles`, `reference` or notebook `outputs`, under the user cache."""
    return cache_root() / name


def data_folder(name: str) -> Path:
    if name not in FOLDERS:
        raise ValueError(f"unknown data folder {name!r}; one of {FOLDERS}")
    configured = os.environ.get(f"SPECBENCH_{name.upper()}")
    if configured:
        return Path(configured).expanduser()
    if os.environ.get("SPECBENCH_DATA"):
        return Path(os.environ["SPECBENCH_DATA"]).expanduser() / name
    checkout = Path(__file__).resolve().parents[1] / name
    if (checkout.parent / "pyproject.toml").exists() and checkout.is_dir():
        return checkout
    for prefix in (sysconfig.get_path("data"), sys.prefix):
        installed = Path(prefix) / "share" / "specbench" / name
        if installed.is_dir():
            return installed
    return checkout  # nothing shipped: where `save_*` will create it
