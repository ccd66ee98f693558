"""Notebook 04 under papermill with injected parameters writes the tidy results file it promises.

(Every notebook also runs under nbmake in `make test`; this checks papermill parameter injection.)
"""
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.real_model
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_notebooks_are_stored_without_outputs():
    import json

    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        # every cell has its id in the file (nbformat only warns, and papermill and nbmake fill one in per run,
        # so a cell added by hand without one passed every run while its id changed each time it was executed)
        assert all("id" in cell for cell in json.loads(path.read_text())["cells"]), path.name
        book = nbformat.read(path, as_version=4)
        assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), path.name
        assert any("parameters" in cell.metadata.get("tags", []) for cell in book.cells), path.name


def test_sweep_notebook_with_injected_parameters(tmp_path, smollm2):
    """Papermill parameters reach the grid: methods x budgets, one row each, one results file per cell.
    (The quantized substitutes themselves are checked in test_real_model.)"""
    import papermill

    out = tmp_path / "sweep.csv"
    papermill.execute_notebook(
        str(NOTEBOOKS / "04_sweep.ipynb"), str(tmp_path / "executed.ipynb"), cwd=str(tmp_path), progress_bar=False,
        parameters={"METHODS": ["target-only", "prompt-lookup", "substitute"],
                    "SUBSTITUTE_QUANTS": ["int8-dynamic"], "BUDGETS": [2, 3], "PROMPTS": 1,
                    "MAX_NEW_TOKENS": 6, "OUT": str(out), "OUT_DIR": str(tmp_path / "cells")}, kernel_name="python3")
    results = pd.read_csv(out)
    assert len(results) == 3 * 2  # methods x budgets
    assert {"method", "tokens_per_s", "acceptance_rate", "tokens_per_step", "target", "dataset", "k"} <= set(results)
    assert set(results["method"]) == {"target-only", "prompt-lookup", "substitute"} and set(results["k"]) == {2, 3}
    assert set(results["substitute_quantization"]) == {"int8-dynamic"}
    assert len(list((tmp_path / "cells" / "cells").glob("*.parquet"))) == 2  # one file per cell
    assert (results["target_weight_mib"] > 500).all()  # the fp32 target, measured as loaded
