"""Run one sweep cell wherever it lands (this process or a Ray worker); models load once per process.

A Ray worker process runs many cells one after another: keeping the loaded models in a small
process-level cache means a grid over budgets or methods loads its target once per worker, not
once per cell, which is most of a small cell's time.
"""
from __future__ import annotations

import os
import platform
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from specbench.hardware import machine_label
from specbench.sweep.grid import SweepCell

_MODELS: "OrderedDict[tuple, object]" = OrderedDict()  # (model, quantization, dtype, device) -> LoadedModel
_loads_done = 0  # models this process has loaded, so a cell can say whether it reused them
MODELS_KEPT = 3  # a worker sweeping many targets keeps the most recent few, not all of them
CELL_COLUMNS = ("target", "target_quantization", "draft", "draft_quantization", "self_draft_layers",
                "substitute_quantization", "dataset", "place", "temperature", "max_new_tokens")


@dataclass
class CellResult:
    """What a cell sends back to the sweep's driver, which alone writes results and artifacts.

    `frame`: step records for a run cell, the profile's grid rows or one reference summary row;
    `artifact`: the LatencyProfile / AcceptanceReference with its metadata, saved by the driver (the
    cell may have run on another machine); `models_loaded`: loads this cell did (0 = all reused).
    """

    key: str
    frame: pd.DataFrame
    artifact: Optional[tuple] = None  # (kind, object, extra metadata)
    seconds: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    host: str = ""
    pid: int = 0
    models_loaded: int = 0


def run_cell(cell: SweepCell, threads: int = 0, progress: bool = False) -> CellResult:
    """Run `cell` here; `threads` > 0 sets torch's thread count first (a Ray task's CPUs); `progress`
    shows the cell's own bar, labelled with the cell (a local sweep: minutes per cell otherwise silent)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    started, loads_before = time.time(), _loads_done
    label = f"cell {cell.describe()}" if progress else False
    frame, artifact = {"run": _run, "reference": _reference, "profile": _profile}[cell.kind](cell, label)
    finished = time.time()
    frame = frame.copy()
    for name in CELL_COLUMNS:
        if name not in frame.columns:
            frame[name] = getattr(cell, name)
    frame.insert(0, "cell", cell.key)
    frame["cell_kind"], frame["host"], frame["threads"] = cell.kind, platform.node(), torch.get_num_threads()
    frame["machine"] = machine_label(cell.device)  # a host name alone: VMs of one name had different CPUs
    return CellResult(key=cell.key, frame=frame, artifact=artifact, seconds=finished - started, started_at=started,
                      finished_at=finished, host=platform.node(), pid=os.getpid(),
                      models_loaded=_loads_done - loads_before)


def _model(cell: SweepCell, name: str, quantization: str):
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    global _loads_done
    key = (name, quantization, cell.dtype, cell.device)
    if key not in _MODELS:
        _MODELS[key] = load_model(ModelSpec(name, dtype=cell.dtype, quantization=quantization, device=cell.device))
        _loads_done += 1
        while len(_MODELS) > MODELS_KEPT:
            _MODELS.popitem(last=False)
    _MODELS.move_to_end(key)
    return _MODELS[key]


def _prompts(cell: SweepCell) -> list:
    if cell.prompts:
        return [p if isinstance(p, str) else list(p) for p in cell.prompts]
    from specbench.datasets import load_prompts

    # the seeded sample `specbench reference --prompts N` and notebook 04 take, so results compare
    rows = load_prompts(cell.dataset, limit=cell.prompt_start + cell.prompt_count)[cell.prompt_start:]
    if not rows:
        raise ValueError(f"dataset {cell.dataset!r} has no rows from {cell.prompt_start}")
    return [row["prompt"] for row in rows]


def _sampling(cell: SweepCell):
    from specbench.types import SamplingParams

    return SamplingParams(temperature=cell.temperature, rule=cell.rule)


def _target(cell: SweepCell):
    if cell.place == "local":
        return _model(cell, cell.target, cell.target_quantization)
    from specbench.models.loading import load_tokenizer
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget

    spec = ModelSpec(cell.target, dtype=cell.dtype, quantization=cell.target_quantization)
    return RemoteTarget(cell.place, model=spec, timeout_s=300.0, tokenizer=load_tokenizer(spec))


def _draft(cell: SweepCell, target):
    if cell.draft:
        return _model(cell, cell.draft, cell.draft_quantization)
    if cell.self_draft_layers and cell.kind == "reference":
        from specbench.models.self_draft import truncated_view

        return truncated_view(target, cell.self_draft_layers)
    return None


def _run(cell: SweepCell, progress: bool | str):
    """The cell's run. Suffix decoding's cache is the cell's own ("drafter"): in the process's shared one, a cell
    after another over the same prompts drafted each from that cell's output of it (SmolLM2, HumanEval: 4.17
    tokens a step at K=8 after a K=4 cell, 1.85 at K=4), so a cell's figure hung on the order cells ran in."""
    from specbench.api import run
    from specbench.decode.suffix_drafter import SuffixSettings

    target = _target(cell)
    records = run(target, _prompts(cell), method=list(cell.methods), draft=_draft(cell, target), k=cell.k,
                  max_new_tokens=cell.max_new_tokens, sampling=_sampling(cell), seed=cell.seed,
                  self_draft_layers=cell.self_draft_layers, substitute_quantization=cell.substitute_quantization,
                  dtype=cell.dtype, progress=progress, suffix=SuffixSettings(cache="drafter"))
    return records, None


def _reference(cell: SweepCell, progress: bool | str):
    from specbench.record import record_reference

    target = _model(cell, cell.target, cell.target_quantization)
    draft = _draft(cell, target)
    prompts = _prompts(cell)
    reference = record_reference(target, draft, prompts, dataset=cell.dataset, max_chain=cell.k,
                                 tree_budgets=cell.tree_budgets, max_new_tokens=cell.max_new_tokens,
                                 sampling=_sampling(cell), progress=progress)
    accepts = pd.Series(reference.chain_accepts, dtype=float)
    summary = pd.DataFrame([{"reference_draft": reference.draft, "reference_target": reference.target,
                             "chain_steps": len(accepts), "mean_accepted": accepts.mean(), "k": cell.k,
                             **{f"tree_{b}_mean_accepted": pd.Series(a, dtype=float).mean()
                                for b, a in reference.tree_accepts.items()}}])
    extra = {"prompts": len(prompts), "max_new_tokens": cell.max_new_tokens, "sweep_cell": cell.key}
    return summary, ("reference", reference, extra)


def _profile(cell: SweepCell, progress: bool | str):
    from specbench.record import profile_model

    target = _model(cell, cell.target, cell.target_quantization)
    if cell.self_draft_layers:
        from specbench.models.self_draft import truncated_view

        target = truncated_view(target, cell.self_draft_layers)
    profile, extra = profile_model(target, tokens=cell.profile_tokens, contexts=cell.profile_contexts,
                                   repeats=cell.profile_repeats, dtype=cell.dtype, progress=bool(progress))
    rows = pd.DataFrame(profile.rows, columns=["tokens", "context", "median_s", "batch"])
    return rows.assign(profile_model=profile.model, device=profile.device), ("profile", profile,
                                                                             {**extra, "sweep_cell": cell.key})
