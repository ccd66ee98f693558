"""Notebook 04 under papermill with injected parameters writes the tidy results file it promises.

(Every notebook also runs under nbmake in `make test`; this checks papermill parameter injection.)
"""
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.real_model
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_sweep_notebook_with_injected_parameters(tmp_path, smollm2):
    import papermill

    out = tmp_path / "sweep.csv"
    papermill.execute_notebook(
        str(NOTEBOOKS / "04_sweep.ipynb"), str(tmp_path / "executed.ipynb"), cwd=str(tmp_path), progress_bar=False,
        parameters={"METHODS": ["target-only", "prompt-lookup"], "BUDGETS": [2, 3], "PROMPTS": 1,
                    "MAX_NEW_TOKENS": 6, "OUT": str(out)}, kernel_name="python3")
    results = pd.read_csv(out)
    assert len(results) == 2 * 2  # methods x budgets, one target, one dataset
    assert {"method", "tokens_per_s", "acceptance_rate", "tokens_per_step", "target", "dataset", "k"} <= set(results)
    assert set(results["method"]) == {"target-only", "prompt-lookup"} and set(results["k"]) == {2, 3}


def test_notebooks_are_stored_without_outputs():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        book = nbformat.read(path, as_version=4)
        assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), path.name
        assert any("parameters" in cell.metadata.get("tags", []) for cell in book.cells), path.name


def test_sweep_notebook_sweeps_quantizations(tmp_path, smollm2):
    import papermill

    out = tmp_path / "sweep.csv"
    papermill.execute_notebook(
        str(NOTEBOOKS / "04_sweep.ipynb"), str(tmp_path / "executed.ipynb"), cwd=str(tmp_path), progress_bar=False,
        parameters={"METHODS": ["target-only", "substitute"], "SUBSTITUTE_QUANTS": ["int8-dynamic", "4bit"],
                    "BUDGETS": [2], "PROMPTS": 1, "MAX_NEW_TOKENS": 6, "OUT": str(out)}, kernel_name="python3")
    results = pd.read_csv(out)
    assert len(results) == 2 * 2  # substitute quantizations x methods
    assert set(results["substitute_quantization"]) == {"int8-dynamic", "4bit"}
    assert (results["target_weight_mib"] > 500).all()  # the fp32 target, measured as loaded
