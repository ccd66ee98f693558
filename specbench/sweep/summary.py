"""One row per (cell, method) of a sweep: the cell's fields beside the method's headline metrics."""
from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Sequence

import pandas as pd

from specbench.decode.metrics import summarize
from specbench.sweep.cells import CELL_COLUMNS as SHOWN
from specbench.sweep.grid import SweepCell


def summarize_sweep(records: pd.DataFrame, cells: Sequence[SweepCell]) -> pd.DataFrame:
    """Headline metrics per (cell, method) of the run cells, with the cell's fields, its budget as `k`
    (a method's own `k` in the records is 0 for target-only), the weights as loaded, in MiB, and the
    speedup over the cell's own target-only run (NaN where the cell ran none), and the machine each cell ran on: a
    resumed sweep, or one on Ray, runs cells on several, said in a warning."""
    runs = records[records["cell_kind"] == "run"] if len(records) else records
    if not len(runs):
        return pd.DataFrame()
    table = summarize(runs, by=["cell", "method"])
    fields = pd.DataFrame([{"cell": c.key, "k": c.k, **{n: asdict(c)[n] for n in SHOWN}} for c in cells])
    weights = (runs.groupby("cell")[["target_weight_bytes", "draft_weight_bytes"]].max() / 2**20).rename(
        columns={"target_weight_bytes": "target_weight_mib", "draft_weight_bytes": "draft_weight_mib"})
    table = table.merge(fields, on="cell", how="left").merge(weights, left_on="cell", right_index=True, how="left")
    # measured side by side in one process: each method's speed over its own cell's target-only
    alone = table[table["method"] == "target-only"].set_index("cell")["tokens_per_s"]
    table["speedup_vs_target_only"] = table["tokens_per_s"] / table["cell"].map(alone)
    if "machine" in runs:  # (records from before machines were kept have none)
        table["machine"] = table["cell"].map(runs.groupby("cell")["machine"].first())
        machines = table.drop_duplicates("cell")["machine"].value_counts()
        if len(machines) > 1:
            listed = ", ".join(f"{machine}: {count} cells" for machine, count in machines.items())
            warnings.warn(f"this sweep's cells ran on {len(machines)} machines ({listed}): tokens_per_s compares only "
                          f"between cells of one machine; speedup_vs_target_only is measured within each cell",
                          stacklevel=2)
    first = ["cell", *SHOWN, "k", "method"]
    return table[first + [c for c in table.columns if c not in first]]
