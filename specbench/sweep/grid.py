"""A sweep as a typed grid: each cell one configuration, named by a hash of everything that defines it.

The hash is what makes a sweep resumable: a cell's results are stored under its hash, so a rerun of
the same grid finds them and skips the cell, and changing any field (a budget, a prompt slice, a
quantization) makes a new cell instead of silently reusing an old one. Torch-free, like `types`.
"""
from __future__ import annotations

import csv
import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, Sequence, Union

from specbench.methods import sampled_rule
from specbench.types import SamplingParams, SpecbenchError, default_rule

CELL_KINDS = ("run", "reference", "profile")
Prompt = Union[str, tuple[int, ...]]


@dataclass(frozen=True)
class SweepCell:
    """One configuration of a sweep.

    kind "run": `methods` run side by side over the prompts (their ratios are measured in one process);
    "reference": the target/draft pair's acceptance with chains up to `k` and trees at `tree_budgets`;
    "profile": the target's forward latency over `profile_tokens` x `profile_contexts` (of its first
    `self_draft_layers` layers when set: the self-draft's profile).
    Prompts are `prompts` when given (text or token ids), else rows `prompt_start`.. of the dataset's
    seeded sample of `prompt_start + prompt_count` rows: with `prompt_start` 0, the same prompts that
    `specbench reference --prompts N`, `run` users and notebook 04 take for N = `prompt_count`.
    `place` is "local" (the target loads where the cell runs) or a worker endpoint (tcp://...).
    """

    kind: str = "run"
    target: str = "smollm2-135m"
    target_quantization: str = "none"
    draft: Optional[str] = None
    draft_quantization: str = "none"
    self_draft_layers: Optional[int] = None
    substitute_quantization: str = "8bit"
    methods: tuple[str, ...] = ("target-only", "chain")
    k: int = 4
    tree_budgets: tuple[int, ...] = ()
    dataset: str = "bench"
    prompt_start: int = 0
    prompt_count: int = 4
    prompts: tuple[Prompt, ...] = ()
    max_new_tokens: int = 64
    place: str = "local"
    temperature: float = 0.0
    rule: Optional[str] = None  # None: greedy at temperature 0, else rejection or what the methods need (sampled_rule)
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"  # where local models load: "cuda" with gpus_per_cell on a GPU cluster
    profile_tokens: tuple[int, ...] = (1, 2, 4, 8, 16)
    profile_contexts: tuple[int, ...] = (128,)
    profile_repeats: int = 5

    def __post_init__(self):
        if self.kind not in CELL_KINDS:
            raise SpecbenchError(f"unknown cell kind {self.kind!r}; choose one of {CELL_KINDS}")
        for name in ("methods", "tree_budgets", "profile_tokens", "profile_contexts"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, (str, int)) else tuple(value))
        object.__setattr__(self, "temperature", float(self.temperature))  # 1 and 1.0: one cell, one hash
        if self.rule is None:  # a run cell's methods may need sample-match (methods.sampled_rule)
            object.__setattr__(self, "rule", sampled_rule(self.temperature, self.methods if self.kind == "run" else ()))
        SamplingParams(temperature=self.temperature, rule=self.rule)  # refused here, not when the cell runs
        object.__setattr__(self, "prompts", tuple(p if isinstance(p, str) else tuple(int(t) for t in p)
                                                  for p in self.prompts))
        if self.kind == "run" and not self.methods:
            raise SpecbenchError("a run cell needs at least one method")
        if self.kind == "reference" and not (self.draft or self.self_draft_layers):
            raise SpecbenchError("a reference cell needs a draft or self_draft_layers")
        for name in ("k", "prompt_count", "max_new_tokens", "profile_repeats"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SpecbenchError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.prompt_start < 0:
            raise SpecbenchError(f"prompt_start must be >= 0, got {self.prompt_start}")

    @property
    def key(self) -> str:
        """16 hex digits of the SHA-256 of the fields that differ from their defaults (canonical JSON):
        the cell's name in the results. Leaving defaults out keeps old results valid when a field is added."""
        chosen = {name: value for name, value in asdict(self).items() if value != _DEFAULTS[name]}
        text = json.dumps(chosen, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        def named(model: str, quantization: str) -> str:
            return model if quantization == "none" else f"{model}@{quantization}"

        draft = (named(self.draft, self.draft_quantization) if self.draft else
                 f"self-draft[:{self.self_draft_layers}]" if self.self_draft_layers else "")
        if self.kind == "profile":
            return (f"{named(self.target, self.target_quantization)}{'/' + draft if draft else ''} profile "
                    f"tokens {list(self.profile_tokens)} x contexts {list(self.profile_contexts)} on {self.device}")
        what = "+".join(self.methods) if self.kind == "run" else "reference"
        prompts = f"{len(self.prompts)} prompts" if self.prompts else f"{self.dataset}[{self.prompt_count}]"
        return f"{named(self.target, self.target_quantization)}{'/' + draft if draft else ''} {what} k={self.k} {prompts}"


FIELD_NAMES = tuple(f.name for f in fields(SweepCell))
_DEFAULTS = {f.name: f.default for f in fields(SweepCell)}
_DEFAULTS["rule"] = default_rule(0.0)  # a greedy cell's key leaves its rule out, as before the rule had no default


def expand(axes: dict, fixed: Optional[dict] = None) -> list[SweepCell]:
    """Every combination of the axes' values, each with the fixed fields.

    Example: expand({"k": [2, 4], "target_quantization": ["none", "int8-dynamic"]}, {"draft": "x"})
    gives 4 cells. A value of `methods` may be a list, so ["target-only", "chain"] as one value runs
    both side by side in one cell.
    """
    fixed = dict(fixed or {})
    _check_names(list(axes) + list(fixed))
    if not axes:
        return [SweepCell(**fixed)]
    names = list(axes)
    for name in names:
        if not isinstance(axes[name], list) or not axes[name]:
            raise SpecbenchError(f"axis {name!r} must be a non-empty list, got {axes[name]!r}")
    return [SweepCell(**fixed, **dict(zip(names, values))) for values in itertools.product(*(axes[n] for n in names))]


def load_grid(path: Union[str, Path]) -> list[SweepCell]:
    """Cells from a JSON grid ({"axes": {...}, "fixed": {...}} or {"grids": [...]} or a list of cells)
    or a CSV table (one cell per row; list fields as JSON, e.g. methods ["target-only","chain"])."""
    path = Path(path)
    if not path.is_file():
        raise SpecbenchError(f"no grid file at {path}")
    if path.suffix == ".csv":
        with path.open(newline="") as handle:
            return [SweepCell(**{name: _csv_value(name, value) for name, value in row.items() if value != ""})
                    for row in _checked_rows(csv.DictReader(handle))]
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SpecbenchError(f"grid file {path} is not valid JSON: {error}") from None
    return grid_cells(spec)


def grid_cells(spec: Union[dict, list]) -> list[SweepCell]:
    """Cells from a parsed JSON grid (see `load_grid`), duplicates removed in order."""
    if isinstance(spec, list):
        _check_names([name for cell in spec for name in cell])
        cells = [SweepCell(**cell) for cell in spec]
    elif isinstance(spec, dict) and "grids" in spec:  # several grids in one file (and a "description")
        cells = [cell for part in spec["grids"] for cell in grid_cells(part)]
    elif isinstance(spec, dict):
        unknown = set(spec) - {"axes", "fixed", "description"}
        if unknown:
            raise SpecbenchError(f"a grid has 'axes' and 'fixed' (got also {sorted(unknown)})")
        cells = expand(spec.get("axes", {}), spec.get("fixed", {}))
    else:
        raise SpecbenchError("a grid is a JSON object (axes/fixed/grids) or a list of cells")
    return list({cell.key: cell for cell in cells}.values())


def _check_names(names: Sequence[str]) -> None:
    unknown = sorted(set(names) - set(FIELD_NAMES))
    if unknown:
        raise SpecbenchError(f"unknown cell field(s) {unknown}; a cell has {list(FIELD_NAMES)}")


def _checked_rows(reader: csv.DictReader):
    _check_names(reader.fieldnames or [])
    return reader


def _csv_value(name: str, text: str):
    kind = {f.name: f.type for f in fields(SweepCell)}[name]
    if text.startswith("["):
        return json.loads(text)
    if kind in ("int", "Optional[int]"):
        return int(text)
    if kind == "float":
        return float(text)
    return text


__all__ = ["SweepCell", "expand", "load_grid", "grid_cells", "CELL_KINDS", "FIELD_NAMES"]
