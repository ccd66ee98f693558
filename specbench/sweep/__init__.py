"""Sweeps: a typed grid of cells run locally or on Ray, stored per cell so reruns resume."""
from specbench.sweep.grid import SweepCell, expand, grid_cells, load_grid
from specbench.sweep.runner import SweepReport, sweep
from specbench.sweep.summary import summarize_sweep

__all__ = ["SweepCell", "SweepReport", "expand", "grid_cells", "load_grid", "summarize_sweep", "sweep"]
