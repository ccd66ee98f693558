"""Run a sweep's unfinished cells in this process or on a Ray cluster; results land per cell as they finish.

Only this driver writes results: a cell returns its records (and any profile or reference) and the
driver stores them under the cell's hash at once, so a crash loses only the cells in flight and a
rerun skips every finished one. On Ray each cell is a task; a task whose worker process dies is
retried by Ray (`max_retries`), an exception inside a cell is recorded as that cell's failure and
the sweep goes on.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import pandas as pd
from tqdm.auto import tqdm

from specbench.sweep.cells import CellResult, run_cell
from specbench.sweep.grid import SweepCell
from specbench.sweep.store import ResultStore
from specbench.types import SpecbenchError

RAY_INSTALL = "pip install 'specbench-lab[ray]'  (or: pip install ray)"


@dataclass
class SweepReport:
    """What a sweep call did: `records` of every finished cell of the grid, `status` one row per cell."""

    records: pd.DataFrame
    status: pd.DataFrame
    ran: int
    skipped: int
    failed: int
    wall_s: float
    folder: Path


def sweep(cells: Sequence[SweepCell], out: Union[str, Path], executor: str = "local", *, cpus_per_cell: int = 1,
          gpus_per_cell: float = 0, max_retries: int = 3, retry_failed: bool = True,
          progress: bool = True) -> SweepReport:
    """Run every cell of `cells` not already finished under `out`.

    `executor`: "local" (one cell after another in this process), "ray" (a local Ray cluster, or the
    one RAY_ADDRESS names), or a Ray address ("auto", "ray://host:10001", "host:6379"). Failed cells
    are run again unless `retry_failed` is False. Returns every finished cell's records.
    """
    started = time.time()
    cells = list({cell.key: cell for cell in cells}.values())
    store = ResultStore(out)
    store.write_grid(cells)
    finished = store.done()
    failed_before = {cell.key for cell in cells if (store.state(cell.key) or {}).get("state") == "failed"}
    pending = [cell for cell in cells if cell.key not in finished and (retry_failed or cell.key not in failed_before)]
    bar = tqdm(total=len(cells), initial=len(cells) - len(pending), desc="sweep", unit="cell", disable=not progress)
    tally = {"done": sum(cell.key in finished for cell in cells), "failed": 0}

    def land(cell: SweepCell, result: Optional[CellResult], error: Optional[str], running: int) -> None:
        if result is not None:
            store.write(cell, result, _save_artifact(store.folder, result))
            tally["done"] += 1
        else:
            store.write_failure(cell, error)
            tally["failed"] += 1
        bar.update()
        bar.set_postfix(done=tally["done"], running=running, failed=tally["failed"])

    if pending:
        if executor == "local":
            _run_local(pending, land)
        else:
            _run_ray(pending, land, executor, cpus_per_cell, gpus_per_cell, max_retries)
    bar.close()
    keys = [cell.key for cell in cells]
    status = store.status()
    skipped = len(cells) - len(pending)
    return SweepReport(records=store.records(keys), status=status[status["cell"].isin(keys)].reset_index(drop=True),
                       ran=len(pending), skipped=skipped, failed=tally["failed"],
                       wall_s=time.time() - started, folder=store.folder)


def _run_local(pending, land) -> None:
    for index, cell in enumerate(pending):
        try:
            result, error = run_cell(cell, progress=True), None
        except Exception as exc:  # a failed cell is recorded and the sweep goes on
            result, error = None, _describe(exc)
        land(cell, result, error, running=1 if index + 1 < len(pending) else 0)


def _run_ray(pending, land, executor: str, cpus_per_cell: int, gpus_per_cell: float, max_retries: int) -> None:
    try:
        import ray
    except ImportError:
        raise SpecbenchError(f"executor {executor!r} needs Ray, which is not installed: {RAY_INSTALL}") from None
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=None if executor == "ray" else executor, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(run_cell).options(num_cpus=cpus_per_cell, num_gpus=gpus_per_cell,
                                             max_retries=max_retries, retry_exceptions=False)
        queue, in_flight = list(pending), {}
        while queue or in_flight:
            slots = _slots(ray, cpus_per_cell, gpus_per_cell)
            while queue and len(in_flight) < slots:  # submit no more than can run: "running" stays true
                cell = queue.pop(0)
                in_flight[task.remote(cell, cpus_per_cell)] = cell
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
            for ref in ready:
                cell = in_flight.pop(ref)
                try:
                    result, error = ray.get(ref), None
                except Exception as exc:  # the cell's own error, or its worker died more than max_retries times
                    result, error = None, _describe(getattr(exc, "cause", None) or exc)
                land(cell, result, error, running=len(in_flight))
    finally:
        if started_here:
            ray.shutdown()


def _slots(ray, cpus_per_cell: int, gpus_per_cell: float) -> int:
    resources = ray.cluster_resources()
    slots = int(resources.get("CPU", 1) // max(cpus_per_cell, 1e-9))
    if gpus_per_cell:
        slots = min(slots, int(resources.get("GPU", 0) // gpus_per_cell))
    return max(slots, 1)


def _describe(error: BaseException) -> str:
    lines = traceback.format_exception_only(type(error), error)
    return "".join(lines).strip()


def _save_artifact(folder: Path, result: CellResult) -> Optional[Path]:
    if result.artifact is None:
        return None
    from specbench.plan.library import save_profile, save_reference

    kind, recorded, extra = result.artifact
    if kind == "profile":
        return save_profile(recorded, extra, folder=folder / "profiles")
    return save_reference(recorded, extra, folder=folder / "reference")
