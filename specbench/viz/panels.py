"""Filling ipywidgets panels without output capture, so widget notebooks also run headless."""
from __future__ import annotations

from typing import Any


def replace_output(output, *items: Any) -> None:
    """Set an `ipywidgets.Output`'s contents to `items` (plotly figures, DataFrames, text) in one update.

    Why not `with output: ...`: capturing routes every display through the frontend's output
    tracking, which headless runners mishandle: nbclient (under nbmake and papermill) can leave a
    cell waiting for its whole timeout (jupyter/nbclient#312). Assigning the outputs as data also
    swaps the panel in one step, so live updates do not flicker.
    """
    output.outputs = tuple(_entry(item) for item in items)


def _entry(item: Any) -> dict:
    if isinstance(item, str):
        return {"output_type": "stream", "name": "stdout", "text": item if item.endswith("\n") else item + "\n"}
    if hasattr(item, "to_plotly_json"):
        # in the representation `use_notebook_figures` chose; displaying the figure would go to the cell instead
        from specbench.viz.figures import figure_data

        data, metadata = figure_data(item), {}
    else:
        from IPython import get_ipython

        shell = get_ipython()
        data, metadata = shell.display_formatter.format(item) if shell else ({"text/plain": repr(item)}, {})
    return {"output_type": "display_data", "data": data, "metadata": metadata}
