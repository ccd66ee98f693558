"""Wire format: a msgpack header frame plus raw array frames; never pickle.

A message is `[header, *arrays]`: the header is a msgpack map whose `arrays` entry lists
`[name, dtype, shape]` for each following frame, so arrays travel as raw bytes with no copy on
either side. Per verify step only tokens, parent indices and the sparse draft distributions
travel; siblings share one q, which is sent once and referenced by index.

Every codec has its inverse here, and every decoder checks type, rank, range and finiteness, so a
malformed request is answered "bad-request" naming the field, and "internal" is left for real bugs.
"""
from __future__ import annotations

import ipaddress
import math
import re
from typing import Any, Optional, Sequence

import msgpack
import numpy as np

from specbench.models.spec import ModelSpec
from specbench.types import DraftTree, SamplingParams, SparseDist, SpecbenchError

PROTOCOL_VERSION = 2
ALLOWED_DTYPES = ("int16", "int32", "int64", "float16", "float32", "float64", "uint16", "uint32")
MAX_RANK = 2
MAX_SEED = 2**63 - 1  # seeds, epochs and committed lengths fit a signed 64-bit int
MAX_DIMENSION = 1 << 30  # elements along one axis, and in all: above any message a worker accepts (`limits.py`)
MAX_NAME = 128
_NAME = re.compile(r"[A-Za-z0-9_.:@+-]{1,128}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")


class ProtocolError(SpecbenchError):
    """A frame that does not decode into a well-formed message."""


class LimitError(SpecbenchError):
    """A request within the protocol but over one of the worker's limits (answered code "limit")."""


def _split_endpoint(endpoint: str) -> tuple[str, str, str]:
    """scheme, host and port of a ZeroMQ address; for ipc:// and inproc:// the path or name, and no port."""
    scheme, _, rest = str(endpoint).partition("://")
    if scheme in ("ipc", "inproc"):
        return scheme, rest, ""
    host, _, port = rest.rpartition(":")
    return scheme, host, port


def check_endpoint(endpoint: str, bind: bool = False) -> None:
    """Refuse, naming the forms, an address ZeroMQ cannot bind or connect to (before: ZMQError "Invalid
    argument", or a worker told to add CURVE keys for an address that was no address)."""
    scheme, host, port = _split_endpoint(endpoint)
    ports = port.isdigit() or (bind and port == "*")
    if not ((scheme in ("ipc", "inproc") and host) or (scheme == "tcp" and host and ports)):
        raise SpecbenchError(f"{'--bind' if bind else 'a worker endpoint'} takes tcp://HOST:PORT "
                             f"(PORT a number{' or *' if bind else ''}), ipc://PATH or inproc://NAME, not {endpoint!r}")


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address: what may be bound without CURVE keys."""
    scheme, host, _ = _split_endpoint(endpoint)
    if scheme in ("ipc", "inproc"):
        return True
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    arrays: dict[str, np.ndarray] = {}
    for spec, frame in zip(specs, frames[1:]):
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
                and spec[1] in ALLOWED_DTYPES and isinstance(spec[2], list) and len(spec[2]) <= MAX_RANK
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[2])):
            raise ProtocolError(f"bad array descriptor {spec!r}: need [name, dtype in {ALLOWED_DTYPES}, "
                                f"shape of at most {MAX_RANK} non-negative ints]")
        name, dtype, shape = spec
        if name in arrays:
            raise ProtocolError(f"array {name!r} appears twice")
        _check_shape(name, shape)
        expected = math.prod(shape) * np.dtype(dtype).itemsize  # Python ints: no overflow
        if len(frame) != expected:
            raise ProtocolError(f"array {name!r} should be {expected} bytes for {dtype}{shape}, got {len(frame)}")
        arrays[name] = np.frombuffer(frame, dtype=dtype).reshape(shape)
    return header, arrays


def _check_shape(name: str, shape: list[int]) -> None:
    """Refuse, before numpy sees it, a dimension no frame could fill. An empty array's byte count is 0
    whatever its other dimensions, so `[2**64 - 1, 0]` passes the size check and made numpy raise
    ("Maximum allowed dimension exceeded"), answered `internal`; each dimension and the product of the
    non-zero ones must stay within the largest frame a worker reads."""
    if any(d > MAX_DIMENSION for d in shape) or math.prod(d for d in shape if d) > MAX_DIMENSION:
        raise ProtocolError(f"array {name!r} has shape {shape}: each dimension, and their product, must be at "
                            f"most {MAX_DIMENSION}")


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


def integer(header: dict, name: str, low: int, high: Optional[int] = None, default: Any = ...) -> int:
    """An int field within [low, high]."""
    value = field(header, name, int, default)
    if value < low or (high is not None and value > high):
        raise ProtocolError(f"field {name!r} = {value} is outside {low}..{high if high is not None else 'inf'}")
    return value


def int_list(header: dict, name: str, low: int, default: Any = ...) -> list[int]:
    """A list of ints >= low (the caller bounds its length and values against the worker's limits)."""
    values = field(header, name, list, default)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in values):
        raise ProtocolError(f"field {name!r} must be a list of integers >= {low}")
    return values


def name_field(header: dict, name: str) -> str:
    value = field(header, name, str)
    if not _NAME.fullmatch(value):
        raise ProtocolError(f"field {name!r} must be 1..{MAX_NAME} characters of letters, digits and _.:@+-")
    return value


def client_token(header: dict) -> str:
    """The client's secret: 16..128 characters, drawn at random by the client and never logged."""
    value = field(header, "client", str)
    if not _TOKEN.fullmatch(value):
        raise ProtocolError("field 'client' must be 16..128 characters of letters, digits, '_' and '-'")
    return value


def array(arrays: dict, name: str, rank: int = 1, integer_ids: bool = True) -> np.ndarray:
    """A required array of the given rank; integer ids, or finite floats."""
    if name not in arrays:
        raise ProtocolError(f"missing array {name!r}")
    values = arrays[name]
    if values.ndim != rank:
        raise ProtocolError(f"array {name!r} must have rank {rank}, got shape {list(values.shape)}")
    if integer_ids and values.dtype.kind not in "iu":
        raise ProtocolError(f"array {name!r} must hold integers, got {values.dtype}")
    if not integer_ids and not np.isfinite(values).all():
        raise ProtocolError(f"array {name!r} holds NaN or infinite values")
    return values


# -- codecs, in pairs ------------------------------------------------------------------------------
def sampling_to_wire(sampling: SamplingParams) -> dict:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "rule": sampling.rule, "draft_top_k": sampling.draft_top_k}


def sampling_from_wire(data: Any) -> SamplingParams:
    if not isinstance(data, dict):
        raise ProtocolError("field 'sampling' must be a map")
    unknown = set(data) - {"temperature", "top_k", "top_p", "rule", "draft_top_k"}
    if unknown:
        raise ProtocolError(f"unknown sampling fields {sorted(map(str, unknown))}")
    try:
        return SamplingParams(**data)
    except SpecbenchError as error:
        raise ProtocolError(f"bad sampling settings: {error}") from None


# suffix decoding's per-step knobs a client may set for its own worker-side requests; the cache's depth and
# size stay the worker's (its cache is shared by the tenant's requests, or by all)
SUFFIX_STEP_FIELDS = ("factor", "offset", "min_prob", "min_score", "hand_over", "other_k", "catch_up", "trust",
                      "bench_below")
# and which of its caches a request drafts from and feeds: absent, the worker's (its tenant's, or everyone's);
# "off", none; any other name, a cache of the client's own under that name (still its tenant's alone)
SUFFIX_CACHE_FIELD = "cache"
MAX_CACHE_NAME = 200


def suffix_to_wire(settings, method: str = "") -> dict:
    """The step knobs of `settings` (a SuffixSettings) that differ from the defaults, and its cache when it is
    not the worker's: "off", a "process" cache's name, or for a "drafter" cache (one `run` call's) the call's
    name with `method`'s, so two methods of one call never draft from each other's outputs. Empty for defaults,
    so a client that sets none sends nothing a worker of before would refuse."""
    from dataclasses import fields

    from specbench.decode.suffix_drafter import SuffixSettings

    default = SuffixSettings()
    kept = [f"{field.name}={getattr(settings, field.name)}" for field in fields(SuffixSettings)
            if field.name not in SUFFIX_STEP_FIELDS + ("cache", "name")
            and getattr(settings, field.name) != getattr(default, field.name)]
    if kept:  # refused, not dropped: the request would draft with the worker's values unbeknown to the client
        raise SpecbenchError(f"suffix settings {kept} are the worker's own (its cache's depth and size); a client "
                             f"sets {list(SUFFIX_STEP_FIELDS)} and which cache (off, a name) for {method or 'a worker method'}")
    wire = {name: getattr(settings, name) for name in SUFFIX_STEP_FIELDS
            if getattr(settings, name) != getattr(default, name)}
    if settings.cache == "off":
        wire[SUFFIX_CACHE_FIELD] = "off"
    elif settings.cache == "drafter":
        wire[SUFFIX_CACHE_FIELD] = f"{settings.name or 'run'}/{method}"
    elif settings.name:
        wire[SUFFIX_CACHE_FIELD] = settings.name
    return wire


def suffix_from_wire(data: Any, caches: bool = True) -> dict:
    """Checked step knobs (changes to apply to the worker's SuffixSettings), each refused by name, and the
    cache the client asked for under `SUFFIX_CACHE_FIELD` where it named one. `caches=False`: a server whose one
    cache serves all its requests (`specbench serve`), where that field is refused like any unknown one."""
    from specbench.decode.suffix_drafter import UNLIMITED, SuffixSettings

    if not isinstance(data, dict):
        raise ProtocolError("field 'suffix' must be a map of suffix decoding settings")
    unknown = set(data) - set(SUFFIX_STEP_FIELDS) - ({SUFFIX_CACHE_FIELD} if caches else set())
    if unknown:
        sets = f" and {SUFFIX_CACHE_FIELD!r}; the cache's size is the worker's" if caches else \
            "; the cache is the server's, one for all its requests"
        raise ProtocolError(f"unknown suffix fields {sorted(map(str, unknown))} (a client sets "
                            f"{list(SUFFIX_STEP_FIELDS)}{sets})")
    data = dict(data)
    cache = data.pop(SUFFIX_CACHE_FIELD, None)
    if cache is not None and (not isinstance(cache, str) or not 0 < len(cache) <= MAX_CACHE_NAME
                              or not cache.isprintable()):
        raise ProtocolError(f"suffix field {SUFFIX_CACHE_FIELD!r} must be 'off' or a cache name of 1-{MAX_CACHE_NAME} "
                            f"printable characters, got {str(cache)[:MAX_CACHE_NAME + 20]!r}")
    for name, value in data.items():
        whole = name == "other_k"
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) \
                or not (math.isfinite(value) or (name in UNLIMITED and value == math.inf)):
            wanted = "whole number" if whole else "number" + (" (or inf)" if name in UNLIMITED else "")
            raise ProtocolError(f"suffix field {name!r} must be a finite {wanted}")
    try:
        SuffixSettings(**data)  # its own range checks
    except (SpecbenchError, TypeError) as error:
        raise ProtocolError(f"bad suffix settings: {error}") from None
    return data if cache is None else dict(data, **{SUFFIX_CACHE_FIELD: cache})


def spec_to_wire(spec: ModelSpec) -> dict:
    return {key: value for key, value in spec.__dict__.items() if value is not None}


def spec_from_wire(data: Any) -> ModelSpec:
    if not isinstance(data, dict):
        raise ProtocolError("field 'model' must be a map of model spec fields")
    allowed = {"model", "gguf_file", "dtype", "device", "quantization", "kernels"}
    unknown = set(data) - allowed
    if unknown:
        raise ProtocolError(f"unknown model spec fields {sorted(map(str, unknown))}")
    if not all(isinstance(value, str) for value in data.values()):
        raise ProtocolError("model spec fields must be strings")
    if not isinstance(data.get("model"), str):
        raise ProtocolError("model spec needs a 'model' string")
    try:
        return ModelSpec(**data)
    except SpecbenchError as error:
        raise ProtocolError(f"bad model spec: {error}") from None


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


def tree_from_arrays(arrays: dict[str, np.ndarray], max_nodes: Optional[int] = None) -> DraftTree:
    """Inverse of `tree_to_arrays`. Token ids are checked against the vocabulary by the target;
    here: ranks, integer kinds, the node limit, and that every q is a finite sub-distribution."""
    tokens, parents = array(arrays, "tokens").tolist(), array(arrays, "parents").tolist()
    if len(tokens) != len(parents):
        raise ProtocolError(f"{len(tokens)} tokens but {len(parents)} parents")
    if max_nodes is not None and len(tokens) > max_nodes:
        raise LimitError(f"a tree of {len(tokens)} nodes exceeds the limit of {max_nodes} tree nodes per verify "
                         f"(--max-tree-nodes)")
    dists = None
    if "node_q" in arrays:
        if not tokens:
            raise ProtocolError("an empty tree carries no draft distributions")
        q_len, q_ids = array(arrays, "q_len"), array(arrays, "q_ids")
        q_probs, node_q = array(arrays, "q_probs", integer_ids=False), array(arrays, "node_q")
        if (q_len < 1).any() or int(q_len.sum()) != len(q_ids) or len(q_ids) != len(q_probs):
            raise ProtocolError("q_len must be positive and add up to the number of q ids and probabilities")
        if (q_ids < 0).any():
            raise ProtocolError("q_ids must be non-negative token ids")
        if ((q_probs < 0) | (q_probs > 1)).any():
            raise ProtocolError("q_probs must lie in [0, 1]")
        offsets = [0] + np.cumsum(q_len, dtype=np.int64).tolist()
        if len(node_q) != len(tokens) or (node_q < 0).any() or (node_q >= len(q_len)).any():
            raise ProtocolError("node_q must give every node a q index in 0..len(q_len)-1")
        table = []
        for a, b in zip(offsets[:-1], offsets[1:]):
            if float(q_probs[a:b].sum(dtype=np.float64)) > 1.0 + 1e-3:
                raise ProtocolError(f"a draft distribution sums to {float(q_probs[a:b].sum()):.4f} > 1")
            table.append(SparseDist(tuple(q_ids[a:b].tolist()), tuple(q_probs[a:b].tolist())))
        dists = tuple(table[i] for i in node_q.tolist())
    elif any(key in arrays for key in ("q_len", "q_ids", "q_probs")):
        raise ProtocolError("draft distributions need node_q, q_len, q_ids and q_probs together")
    try:
        return DraftTree(tuple(tokens), tuple(parents), dists)
    except SpecbenchError as error:
        raise ProtocolError(str(error)) from None
