"""The worker's tokenizer, carried to its clients as files: tokens travel per step, text does not, so a
client given text prompts (or a draft of another tokenizer) needs the target's tokenizer on its side.

Why as files: `save_pretrained` writes what `AutoTokenizer.from_pretrained` reads back, whatever the
model's family; the files are data (no code is loaded: `trust_remote_code` stays off), and their names
are checked before anything is written on the client.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Optional

from specbench.types import SpecbenchError

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
MAX_FILES = 32
_loaded: dict[str, object] = {}  # per process, by the worker's model identity: one fetch per model


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files of `tokenizer` as `save_pretrained` writes them (empty when there is none)."""
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="specbench-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir()) if path.is_file()}


def known_tokenizer(identity: str) -> tuple[bool, Optional[object]]:
    """(whether this process already holds the tokenizer of the model `identity` names, that tokenizer)."""
    return identity in _loaded, _loaded.get(identity)


def tokenizer_from_files(files: dict, identity: str) -> Optional[object]:
    """The tokenizer the files describe (None for none), loaded once per `identity` in this process;
    a name that is not a plain file name, or files that do not load, are refused naming the worker's model."""
    from transformers import AutoTokenizer

    if identity in _loaded:
        return _loaded[identity]
    if not isinstance(files, dict) or len(files) > MAX_FILES or not all(
            isinstance(name, str) and _NAME.fullmatch(name) and isinstance(data, bytes)
            for name, data in files.items()):
        raise SpecbenchError(f"the worker's tokenizer for {identity} came as something other than at most {MAX_FILES} "
                             f"plain named files: pass RemoteTarget(..., tokenizer=load_tokenizer(name)) instead")
    tokenizer = None
    if files:
        with tempfile.TemporaryDirectory(prefix="specbench-tokenizer-") as folder:
            for name, data in files.items():
                (Path(folder) / name).write_bytes(data)
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder)
            except Exception as error:  # transformers raises many kinds on files it cannot read
                raise SpecbenchError(f"the worker's tokenizer for {identity} did not load here ({type(error).__name__}"
                                     f": {error}): pass RemoteTarget(..., tokenizer=load_tokenizer(name))") from None
    _loaded[identity] = tokenizer
    return tokenizer
