"""Notebook 03's Pareto explorer: its controls, and a panel that every control redraws or explains.

Why a module: the notebook is what users see, but its behaviour must be testable control by
control (a control that fails must say so in the panel, not in JupyterLab's log console).
"""
from __future__ import annotations

from typing import Optional, Sequence

import ipywidgets as widgets

from specbench.plan.costs import Power, Prices, PRESETS
from specbench.plan.explore import (cost_column, cs_ranges, cs_summary, operating_points, prediction_frame,
                                    recommend)
from specbench.viz.figures import pareto_figure
from specbench.viz.panels import replace_output

OBJECTIVES = ("total_cost", "api_cost", "draft_energy", "target_energy")
RTT_CHOICES_MS = (5.0, 10.0, 25.0, 50.0, 100.0, 200.0)


class ParetoExplorer:
    """Pick a cached pair, places, RTTs, prices, clients, cost objective and weight `cs`; the panel shows
    the Pareto figure, the table, the recommendation per preset and how it moves with cs.

    `pairs` maps a title to (target profile, draft profile, reference), as notebook 03 builds it.
    After every change `frame` holds the predictions drawn, or None with `message` saying why not.
    """

    def __init__(self, pairs: dict, pair: Optional[str] = None, places: Sequence[str] = ("local", "remote"),
                 rtts_ms: Sequence[float] = (10.0, 50.0, 100.0), cs: float = 0.5, objective: str = "total_cost",
                 clients: int = 1, target_usd_per_hour: float = 2.0, usd_per_gb_down: float = 0.09):
        if not pairs:
            raise ValueError("no cached pairs: run notebook 05 or `specbench profile` / `specbench reference`")
        self.pairs = pairs
        self.controls = {
            "pair": widgets.Dropdown(options=list(pairs), value=pair or next(iter(pairs)), description="pair",
                                     layout=widgets.Layout(width="95%")),
            "place": widgets.SelectMultiple(options=["local", "remote"], value=tuple(places), description="place"),
            "rtts": widgets.SelectMultiple(options=sorted({*RTT_CHOICES_MS, *rtts_ms}), value=tuple(rtts_ms),
                                           description="RTT ms"),
            "usd_hour": widgets.FloatSlider(value=target_usd_per_hour, min=0.1, max=10, step=0.1,
                                            description="target $/h"),
            "usd_gb": widgets.FloatSlider(value=usd_per_gb_down, min=0, max=0.5, step=0.01, description="$/GB down"),
            "cs": widgets.FloatSlider(value=cs, min=0, max=1, step=0.05, description="cs"),
            "objective": widgets.Dropdown(options=OBJECTIVES, value=objective, description="cost"),
            "clients": widgets.IntSlider(value=clients, min=1, max=16, description="clients",
                                         tooltip="concurrent clients sharing the remote target (batched verification)"),
        }
        self.output = widgets.Output()
        self.frame = None
        self.message = ""
        for control in self.controls.values():
            control.observe(self.update, names="value")

    @property
    def view(self) -> widgets.VBox:
        c = self.controls
        return widgets.VBox([c["pair"], widgets.HBox([c["place"], c["rtts"]]), widgets.HBox([c["usd_hour"], c["usd_gb"]]),
                             widgets.HBox([c["cs"], c["objective"]]), c["clients"], self.output])

    def predictions(self):
        """The predicted frame for the current controls (raises with the reason when it cannot)."""
        c = self.controls
        target, draft, reference = self.pairs[c["pair"].value]
        points = operating_points(reference, rtts_ms=c["rtts"].value, local="local" in c["place"].value,
                                  remote="remote" in c["place"].value, clients=(c["clients"].value,))
        prices = Prices(target_usd_per_hour=c["usd_hour"].value, usd_per_gb_down=c["usd_gb"].value)
        return prediction_frame(target, draft, reference, points, prices, Power(), cost=c["objective"].value)

    def update(self, *_):
        """Redraw the panel; on any failure the panel says what went wrong and which control to change."""
        c = self.controls
        try:
            if not c["rtts"].value and "remote" in c["place"].value:
                raise ValueError("remote is chosen but no RTT is: pick at least one RTT")
            frame = self.predictions()
            objective, column = c["objective"].value, cost_column(c["objective"].value)
            best = recommend(frame, c["cs"].value, objective)
            picks = {name: recommend(frame, value, objective)["label"] for name, value in PRESETS.items()}
            self.message = cs_summary(cs_ranges(frame, objective))
            replace_output(self.output,
                           pareto_figure(frame, cost=column, recommended=best,
                                         title=f"{c['pair'].value}<br>recommended at cs={c['cs'].value:g}: "
                                               f"{best['label']}"),
                           self.message, f"recommended per preset: {picks}",
                           frame[["label", "tokens_per_s", "aggregate_tokens_per_s", column, "on_front"]]
                           .sort_values("tokens_per_s", ascending=False).round(4))
        except Exception as error:  # every failure reaches the panel, never only the log console
            self.frame, self.message = None, f"cannot draw this view: {type(error).__name__}: {error}"
            replace_output(self.output, self.message)
            return None
        self.frame = frame
        return frame
