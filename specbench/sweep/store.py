"""A sweep's results on disk, one file per cell keyed by its hash, so nothing finished is ever redone or lost.

Layout under the sweep's folder:
  grid.json                 every cell of the grid (what `status` reports against)
  cells/<key>.parquet       the cell's records, written before its status
  cells/<key>.json          {"state": "done" | "failed", "cell": ..., "seconds": ..., "error": ...}
  profiles/, reference/     profiles and references recorded by profile/reference cells

Every file is written to a temporary name and renamed, so a crash mid-write leaves the old file or
none: a cell is finished exactly when its status says "done" and its parquet exists.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Optional, Union

import pandas as pd

from specbench.files import replacing, write_text
from specbench.sweep.cells import CellResult
from specbench.sweep.grid import SweepCell
from specbench.types import SpecbenchError, reason


class ResultStore:
    def __init__(self, folder: Union[str, Path]):
        self.folder = Path(folder)
        self.cells_folder = self.folder / "cells"
        self.cells_folder.mkdir(parents=True, exist_ok=True)

    def write_grid(self, cells: Iterable[SweepCell]) -> None:
        known = {cell["key"]: cell for cell in self._grid()}
        known.update({cell.key: {"key": cell.key, **asdict(cell)} for cell in cells})
        write_text(self.folder / "grid.json", json.dumps(list(known.values()), indent=1))

    def state(self, key: str) -> Optional[dict]:
        path = self.cells_folder / f"{key}.json"
        try:
            status = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as error:
            raise SpecbenchError(f"sweep status file {path} is unreadable ({error}); delete it to rerun that cell")
        if not isinstance(status, dict):
            raise SpecbenchError(f"sweep status file {path} holds no status ({type(status).__name__}); delete it to "
                                 f"rerun that cell")
        if status.get("state") == "done" and not (self.cells_folder / f"{key}.parquet").exists():
            return None  # status without records cannot happen through write(); treat the cell as not run
        return status

    def done(self) -> set[str]:
        return {path.stem for path in self.cells_folder.glob("*.json")
                if (self.state(path.stem) or {}).get("state") == "done"}

    def write(self, cell: SweepCell, result: CellResult, artifact_path: Optional[Path] = None) -> None:
        with replacing(self.cells_folder / f"{cell.key}.parquet") as temporary:
            result.frame.to_parquet(temporary, index=False)
        self._status(cell, state="done", seconds=result.seconds, started_at=result.started_at,
                     finished_at=result.finished_at, host=result.host, pid=result.pid,
                     models_loaded=result.models_loaded, artifact=str(artifact_path) if artifact_path else None)

    def write_failure(self, cell: SweepCell, error: str) -> None:
        self._status(cell, state="failed", error=error)

    def records(self, keys: Optional[Iterable[str]] = None) -> pd.DataFrame:
        """Every finished cell's records (or those of `keys`), in one frame."""
        keys = sorted(self.done() if keys is None else set(keys) & self.done())
        frames = [_cell_records(self.cells_folder / f"{key}.parquet") for key in keys]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def status(self) -> pd.DataFrame:
        """One row per cell of the grid: its state (done / failed / pending), time, where it ran, error."""
        rows = []
        for cell in self._grid():
            status = self.state(cell["key"]) or {"state": "pending"}
            rows.append({"cell": cell["key"], "state": status["state"],
                         "describe": SweepCell(**{k: v for k, v in cell.items() if k != "key"}).describe(),
                         "seconds": status.get("seconds"), "host": status.get("host"), "pid": status.get("pid"),
                         "models_loaded": status.get("models_loaded"), "error": status.get("error")})
        return pd.DataFrame(rows, columns=["cell", "state", "describe", "seconds", "host", "pid", "models_loaded",
                                           "error"])

    def _grid(self) -> list[dict]:
        path = self.folder / "grid.json"
        return json.loads(path.read_text()) if path.exists() else []

    def _status(self, cell: SweepCell, **fields) -> None:
        write_text(self.cells_folder / f"{cell.key}.json", json.dumps({**fields, "cell": asdict(cell)}, indent=1))


def _cell_records(path: Path) -> pd.DataFrame:
    """A finished cell's records (written whole); a file that does not read is named, with how to rerun it."""
    try:
        return pd.read_parquet(path)
    except Exception as error:  # pyarrow's ArrowInvalid, OSError, ...: one cause, many kinds
        raise SpecbenchError(f"sweep cell records {path} are unreadable ({reason(error)}); delete it and "
                             f"{path.stem}.json to rerun that cell") from None
