"""Wire format: a msgpack header frame plus raw array frames; never pickle.

A message is `[header, *arrays]`: the header is a msgpack map whose `arrays` entry lists
`[name, dtype, shape]` for each following frame, so arrays travel as raw bytes with no copy on
either side. Per verify step only tokens, parent indices and the sparse draft distributions
travel; siblings share one q, which is sent once and referenced by index.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import msgpack
import numpy as np

from specbench.types import DraftTree, SamplingParams, SparseDist, SpecbenchError

PROTOCOL_VERSION = 1
ALLOWED_DTYPES = ("int16", "int32", "int64", "float32", "float64", "uint16", "uint32")


class ProtocolError(SpecbenchError):
    """A frame that does not decode into a well-formed message."""


def encode(header: dict, arrays: Optional[dict[str, np.ndarray]] = None) -> list[bytes]:
    """Header dict + named arrays -> frames ready for `send_multipart`."""
    arrays = arrays or {}
    header = dict(header, arrays=[[name, str(a.dtype), list(a.shape)] for name, a in arrays.items()])
    return [msgpack.packb(header, use_bin_type=True)] + [np.ascontiguousarray(a).tobytes() for a in arrays.values()]


def decode(frames: Sequence[bytes]) -> tuple[dict, dict[str, np.ndarray]]:
    """Inverse of `encode`; raises ProtocolError naming what is wrong."""
    if not frames:
        raise ProtocolError("empty message: expected a msgpack header frame")
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    except Exception as error:
        raise ProtocolError(f"header frame is not valid msgpack ({type(error).__name__}: {error})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    specs = header.pop("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        count = len(specs) if isinstance(specs, list) else "?"
        raise ProtocolError(f"header announces {count} array frames but {len(frames) - 1} followed")
    arrays = {}
    for spec, frame in zip(specs, frames[1:]):
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
                and spec[1] in ALLOWED_DTYPES and isinstance(spec[2], list)
                and all(isinstance(d, int) and d >= 0 for d in spec[2])):
            raise ProtocolError(f"bad array descriptor {spec!r}: need [name, dtype in {ALLOWED_DTYPES}, shape]")
        name, dtype, shape = spec
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if len(frame) != expected:
            raise ProtocolError(f"array {name!r} should be {expected} bytes for {dtype}{shape}, got {len(frame)}")
        arrays[name] = np.frombuffer(frame, dtype=dtype).reshape(shape)
    return header, arrays


def field(header: dict, name: str, kind, default: Any = ...) -> Any:
    """A typed header field, or a ProtocolError naming the field."""
    if name not in header:
        if default is ...:
            raise ProtocolError(f"missing field {name!r}")
        return default
    value = header[name]
    if isinstance(value, bool) and kind is not bool:
        raise ProtocolError(f"field {name!r} must be {kind.__name__}, got bool")
    if not isinstance(value, kind):
        raise ProtocolError(f"field {name!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def sampling_to_wire(sampling: SamplingParams) -> dict:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "rule": sampling.rule, "draft_top_k": sampling.draft_top_k}


def sampling_from_wire(data: Any) -> SamplingParams:
    if not isinstance(data, dict):
        raise ProtocolError("field 'sampling' must be a map")
    try:
        return SamplingParams(**data)
    except TypeError as error:
        raise ProtocolError(f"bad sampling settings: {error}") from None


def tree_to_arrays(tree: DraftTree) -> dict[str, np.ndarray]:
    """Tokens, parents, and each distinct q once (siblings share theirs), as compact arrays."""
    arrays = {"tokens": np.asarray(tree.tokens, dtype=np.int32),
              "parents": np.asarray(tree.parents, dtype=np.int16 if len(tree) < 2**15 else np.int32)}
    if tree.draft_dists is not None and len(tree):
        index_of: dict[SparseDist, int] = {}
        node_q = [index_of.setdefault(dist, len(index_of)) for dist in tree.draft_dists]
        dists = list(index_of)
        arrays["node_q"] = np.asarray(node_q, dtype=np.uint16)
        arrays["q_len"] = np.asarray([len(d.ids) for d in dists], dtype=np.uint16)
        arrays["q_ids"] = np.asarray([t for d in dists for t in d.ids], dtype=np.int32)
        arrays["q_probs"] = np.asarray([p for d in dists for p in d.probs], dtype=np.float32)
    return arrays


def tree_from_arrays(arrays: dict[str, np.ndarray]) -> DraftTree:
    if "tokens" not in arrays or "parents" not in arrays:
        raise ProtocolError("a tree needs 'tokens' and 'parents' arrays")
    tokens, parents = arrays["tokens"].tolist(), arrays["parents"].tolist()
    if len(tokens) != len(parents):
        raise ProtocolError(f"{len(tokens)} tokens but {len(parents)} parents")
    dists = None
    if "node_q" in arrays:
        q_len, q_ids, q_probs = (arrays.get(k) for k in ("q_len", "q_ids", "q_probs"))
        if q_len is None or q_ids is None or q_probs is None:
            raise ProtocolError("draft distributions need node_q, q_len, q_ids and q_probs")
        if int(q_len.sum()) != len(q_ids) or len(q_ids) != len(q_probs):
            raise ProtocolError("q_len does not add up to the number of q ids and probabilities")
        offsets = [0] + np.cumsum(q_len, dtype=np.int64).tolist()
        table = [SparseDist(tuple(q_ids[a:b].tolist()), tuple(q_probs[a:b].tolist()))
                 for a, b in zip(offsets[:-1], offsets[1:])]
        node_q = arrays["node_q"].tolist()
        if len(node_q) != len(tokens) or any(i >= len(table) for i in node_q):
            raise ProtocolError("node_q must give every node a valid q index")
        dists = tuple(table[i] for i in node_q)
    return DraftTree(tuple(tokens), tuple(parents), dists)
