"""profiles/ and reference/ files: JSON with a schema version and full metadata, named by a hash of
that metadata, written atomically, with a readable index beside them.

A corrupt or old-schema file raises CacheError naming the file and the command that rebuilds it;
concurrent writers never leave a half-written file (`specbench.files`: write beside, then rename) and the
index is updated under a file lock.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Optional

from specbench.files import replacing, write_text
from specbench.types import SpecbenchError

SCHEMA_VERSIONS = {"profile": 1, "reference": 1, "concurrency": 1}
REBUILD = {"profile": "specbench profile", "reference": "specbench reference",
           "concurrency": "python benchmarks/concurrency.py --save-measured"}


class CacheError(SpecbenchError):
    """A cache file that cannot be used as it is."""


def metadata_key(metadata: dict) -> str:
    canonical = json.dumps(metadata, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in text)[:60].strip("-")


def write_record(folder: Path | str, kind: str, metadata: dict, payload: dict, label: str = "") -> Path:
    """Write one record; the same metadata always lands in the same file (a re-measurement replaces it)."""
    if kind not in SCHEMA_VERSIONS:
        raise SpecbenchError(f"unknown cache kind {kind!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = metadata_key(metadata)
    path = folder / f"{kind}-{_slug(label) + '-' if label else ''}{key}.json"
    document = {"schema": SCHEMA_VERSIONS[kind], "kind": kind, "key": key, "metadata": metadata, "payload": payload}
    with replacing(path) as temporary, open(temporary, "w") as handle:
        json.dump(document, handle, indent=1, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    _update_index(folder, path.name, kind, metadata)
    return path


def read_record(path: Path | str, kind: Optional[str] = None) -> tuple[dict, dict]:
    """(metadata, payload) of a record, or CacheError saying what is wrong and how to rebuild it."""
    path = Path(path)
    expected = kind or path.name.split("-", 1)[0]
    rebuild = REBUILD.get(expected, "the command that wrote it")
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CacheError(f"cache file {path} is unreadable or corrupt ({error}); delete it and rerun "
                         f"`{rebuild}` to rebuild it") from None
    if not isinstance(document, dict) or not {"schema", "kind", "metadata", "payload"} <= set(document):
        raise CacheError(f"cache file {path} lacks schema/kind/metadata/payload; delete it and rerun `{rebuild}`")
    if kind and document["kind"] != kind:
        raise CacheError(f"cache file {path} holds a {document['kind']!r} record, not {kind!r}")
    version = SCHEMA_VERSIONS.get(document["kind"])
    if document["schema"] != version:
        raise CacheError(f"cache file {path} has schema {document['schema']}, this specbench reads {version}; "
                         f"rerun `{rebuild}` to rebuild it")
    return document["metadata"], document["payload"]


def iter_records(folder: Path | str, kind: str) -> Iterator[tuple[Path, dict, dict]]:
    for path in sorted(Path(folder).glob(f"{kind}-*.json")):
        metadata, payload = read_record(path, kind)
        yield path, metadata, payload


def find_records(folder: Path | str, kind: str, **match) -> list[tuple[Path, dict, dict]]:
    """Records whose metadata has every given key=value."""
    return [(path, metadata, payload) for path, metadata, payload in iter_records(folder, kind)
            if all(metadata.get(key) == value for key, value in match.items())]


def _update_index(folder: Path, name: str, kind: str, metadata: dict) -> None:
    """index.json maps file name -> a short readable summary; updated under an exclusive lock."""
    with open(folder / ".index.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index_path = folder / "index.json"
        try:
            index = json.loads(index_path.read_text()) if index_path.exists() else {}
        except ValueError:
            index = {}  # the index is derived data: rebuild it rather than fail
        summary_keys = ("device", "model", "draft", "target", "quantization", "dtype", "dataset", "method", "date")
        index[name] = {"kind": kind, **{k: metadata[k] for k in summary_keys if k in metadata}}
        write_text(index_path, json.dumps(dict(sorted(index.items())), indent=1, default=str))
