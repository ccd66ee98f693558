"""Plotly figures built from DataFrames only (predictions and per-step records); no model code here."""
from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go

from specbench.decode.metrics import per_position_acceptance, time_split, tokens_per_second
from specbench.plan.reference import HYBRIDS

SPEED = "tokens_per_s"
COLORS = {"target-only": "#636efa", "chain": "#ef553b", "tree": "#00cc96"}
SYMBOLS = {"target-only": "square", "chain": "circle", "tree": "diamond",
           **{hybrid: "star" for hybrid in HYBRIDS}}  # suffix decoding's hybrids with a draft


_EXPORT = {"on": False}  # set by use_notebook_figures: what a figure's output holds


def use_notebook_figures(export: bool = False) -> None:
    """One representation per figure. By default plotly's JSON only, which JupyterLab's plotly
    extension (installed with plotly) draws: a saved notebook stays small (plotly.js inlined, plus
    JSON, HTML and PNG per figure, made each notebook ~5 MB). `export=True` (for an nbconvert or
    papermill copy read in a browser, offline): HTML only, with plotly.js inlined once, into THIS
    cell's output (otherwise it lands in the first figure's, which may sit in a widget)."""
    import plotly.io as pio

    _EXPORT["on"] = export
    if export:
        from plotly.offline import init_notebook_mode

        init_notebook_mode(connected=False)
        pio.renderers.default = "notebook"
    else:
        pio.renderers.default = "plotly_mimetype"


def figure_data(figure: go.Figure) -> dict:
    """A figure as display data for a widget's output, in the representation `use_notebook_figures` chose."""
    import json

    import plotly.io as pio

    if _EXPORT["on"]:  # needs plotly.js on the page, which use_notebook_figures(export=True) put there
        return {"text/html": pio.to_html(figure, include_plotlyjs=False, full_html=False)}
    return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(figure, validate=False))}


def pareto_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame] = None,
                  cost: str = "total_cost_usd_per_mtok", recommended: Optional[pd.Series] = None,
                  title: str = "Latency-cost trade-off", by: str = "method") -> go.Figure:
    """Predicted points (hover: label), the predicted Pareto front as a line, measured points overlaid.

    `measured` needs columns label, tokens_per_s and the cost column; each is drawn as a diamond so
    a reader sees at once where prediction and measurement part. Nothing is interpolated: the front
    joins predicted operating points, each of which was predicted from measured inputs. `by` names
    the column that colours the points (`variant`: one colour per draft/quantization, the method then
    shown by the marker); points with `fits` False (over the draft's memory budget) are drawn grey.
    """
    figure = go.Figure()
    fits = predicted["fits"] if "fits" in predicted else pd.Series(True, index=predicted.index)
    for name, group in predicted[fits].groupby(by, sort=False):
        figure.add_trace(go.Scatter(
            x=group[cost], y=group[SPEED], mode="markers", name=f"predicted: {name}",
            marker=dict(size=9, color=COLORS.get(name), opacity=0.7,
                        symbol=[SYMBOLS.get(method, "circle") for method in group["method"]]),
            text=group["label"], hovertemplate="%{text}<br>%{y:.2f} tok/s<br>%{x:.4g}<extra></extra>"))
    if (~fits).any():
        over = predicted[~fits]
        figure.add_trace(go.Scatter(
            x=over[cost], y=over[SPEED], mode="markers", name="does not fit the draft memory budget",
            marker=dict(size=9, color="lightgrey", symbol="x"), text=over["label"],
            hovertemplate="%{text} (over budget)<br>%{y:.2f} tok/s<br>%{x:.4g}<extra></extra>"))
    front = predicted[predicted["on_front"]].sort_values(cost)
    figure.add_trace(go.Scatter(x=front[cost], y=front[SPEED], mode="lines", name="Pareto front (predicted)",
                                line=dict(color="black", dash="dot")))
    if measured is not None and len(measured):
        figure.add_trace(go.Scatter(
            x=measured[cost], y=measured[SPEED], mode="markers", name="measured",
            marker=dict(size=12, symbol="diamond-open", color="black", line=dict(width=2)),
            text=measured["label"], hovertemplate="measured %{text}<br>%{y:.2f} tok/s<br>%{x:.4g}<extra></extra>"))
    if recommended is not None:  # its label goes in the hover and the caller's title, not beside the star,
        # where a long label ("qwen2.5-coder-0.5b@8bit: tree budget=16 (remote 10 ms)") was cut at the edge
        figure.add_trace(go.Scatter(
            x=[recommended[cost]], y=[recommended[SPEED]], mode="markers", name="recommended",
            marker=dict(size=18, symbol="star", color="gold", line=dict(width=1, color="black")),
            text=[recommended["label"]],
            hovertemplate="recommended: %{text}<br>%{y:.2f} tok/s<br>%{x:.4g}<extra></extra>"))
    figure.update_layout(title=dict(text=title, font=dict(size=14)), xaxis_title=_cost_title(cost),
                         yaxis_title="tokens/s (higher is better)", template="plotly_white", **_BELOW_LEGEND)
    return figure


# The legend under the plot, in rows, with the figure tall enough that it never squeezes the axes
# (at the side, a legend of eight variants took half the width of a notebook's output).
_BELOW_LEGEND = dict(height=620, margin=dict(l=60, r=20, t=80, b=40),
                     legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0, font=dict(size=11)))


def acceptance_figure(records: pd.DataFrame, by: str = "method") -> go.Figure:
    """P(position j accepted | drafted) per method: where a longer chain stops paying."""
    figure = go.Figure()
    for name, group in records.groupby(by, sort=False):
        if group["drafted"].sum() == 0:
            continue
        rates = per_position_acceptance(group)
        figure.add_trace(go.Bar(x=list(rates.index), y=list(rates.values), name=str(name)))
    figure.update_layout(title="Per-position acceptance", xaxis_title="draft position",
                         yaxis_title="P(accepted | drafted)", yaxis_range=[0, 1], barmode="group",
                         template="plotly_white")
    return figure


def time_breakdown_figure(records: pd.DataFrame, by: str = "method") -> go.Figure:
    """Mean milliseconds per step split into draft / network / verify / overhead, one bar per method."""
    names, parts = [], {"draft_s": [], "network_s": [], "verify_s": [], "overhead_s": []}
    for name, group in records.groupby(by, sort=False):
        names.append(f"{name} ({tokens_per_second(group):.1f} tok/s)")
        for key, value in time_split(group).items():
            parts[key].append(1000 * value)
    figure = go.Figure([go.Bar(x=names, y=values, name=key[:-2]) for key, values in parts.items()])
    figure.update_layout(title="Time per step", yaxis_title="ms per step", barmode="stack", template="plotly_white")
    return figure


def _cost_title(column: str) -> str:
    from specbench.plan.objectives import by_column

    objective = by_column(column)
    if objective is None:
        return f"{column} (lower is better)"
    per = "per generated token" if objective.unit == "s" else "per 1M tokens"
    return f"{objective.name.replace('_', ' ')} ({objective.unit} {per}, lower is better)"


def concurrency_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame] = None,
                       title: str = "SD speedup over target-only vs clients sharing the target") -> go.Figure:
    """One line per chain K / tree budget (from `plan.explore.concurrency_frame`); measured speedups
    (columns clients, series, speedup) as diamonds. Below 1, drafting costs more than it saves."""
    figure = go.Figure()
    for series, group in predicted.groupby("series", sort=False):
        figure.add_trace(go.Scatter(x=group["clients"], y=group["speedup"], mode="lines+markers",
                                    name=f"predicted: {series}"))
    if measured is not None and len(measured):
        for series, group in measured.groupby("series", sort=False):
            figure.add_trace(go.Scatter(x=group["clients"], y=group["speedup"], mode="markers",
                                        name=f"measured: {series}",
                                        marker=dict(size=12, symbol="diamond-open", line=dict(width=2))))
    figure.add_hline(y=1.0, line=dict(color="grey", dash="dash"))
    figure.update_layout(title=title, xaxis_title="concurrent clients", yaxis_title="speedup (tokens/s per client)",
                         template="plotly_white", **_BELOW_LEGEND)
    return figure
