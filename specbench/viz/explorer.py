"""Notebook 03's Pareto explorer: its controls, and a panel that every control redraws or explains.

Why a module: the notebook is what users see, but its behaviour must be testable control by
control (a control that fails must say so in the panel, not in JupyterLab's log console).
"""
from __future__ import annotations

from typing import Optional, Sequence

import ipywidgets as widgets

from specbench.plan.costs import Power, Prices, PRESETS
from specbench.models.spec import QUANTIZATIONS
from specbench.plan.explore import (OBJECTIVE_COLUMNS, cost_column, cs_ranges, cs_summary, operating_points, recommend,
                                    variants_frame)
from specbench.viz.figures import pareto_figure
from specbench.viz.panels import replace_output

OBJECTIVES = tuple(OBJECTIVE_COLUMNS)
RTT_CHOICES_MS = (5.0, 10.0, 25.0, 50.0, 100.0, 200.0)


class ParetoExplorer:
    """Pick a target family (all its cached drafts and quantizations), which target and draft quantizations
    to show, the draft device's memory budget, places, RTTs, prices, clients, cost objective and weight
    `cs`; the panel shows the Pareto figure coloured by draft/quantization, the table, the recommendation
    per preset and how it moves with cs.

    `groups` maps a title to its (target profile, draft profile, reference) combos (`target_groups`).
    After every change `frame` holds the predictions drawn, or None with `message` saying why not.
    """

    def __init__(self, groups: dict, group: Optional[str] = None, places: Sequence[str] = ("local", "remote"),
                 rtts_ms: Sequence[float] = (10.0, 50.0, 100.0), cs: float = 0.5, objective: str = "total_cost",
                 clients: int = 1, target_usd_per_hour: float = 2.0, usd_per_gb_down: float = 0.09,
                 context: int = 256):
        if not groups:
            raise ValueError("no cached pairs: run notebook 05 or `specbench profile` / `specbench reference`")
        self.groups, self.context, self._syncing = groups, context, False
        self.controls = {
            "target": widgets.Dropdown(options=list(groups), value=group or next(iter(groups)), description="target",
                                       layout=widgets.Layout(width="95%")),
            "target_quant": widgets.SelectMultiple(description="target quant"),
            "draft_quant": widgets.SelectMultiple(description="draft quant"),
            "budget_mib": widgets.FloatSlider(description="draft MiB", tooltip="draft device memory budget: "
                                              "weights + a cache of the context; points over it are greyed"),
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
        self._sync_choices()
        self.controls["target"].observe(self._on_target, names="value")
        for name, control in self.controls.items():
            if name != "target":
                control.observe(self.update, names="value")

    @property
    def view(self) -> widgets.VBox:
        c = self.controls
        return widgets.VBox([c["target"], widgets.HBox([c["target_quant"], c["draft_quant"], c["budget_mib"]]),
                             widgets.HBox([c["place"], c["rtts"]]), widgets.HBox([c["usd_hour"], c["usd_gb"]]),
                             widgets.HBox([c["cs"], c["objective"]]), c["clients"], self.output])

    def _sync_choices(self) -> None:
        """The quantization pickers and the budget range offer exactly what the chosen family's caches hold."""
        self._syncing = True
        try:
            combos = self.groups[self.controls["target"].value]
            for name, of in (("target_quant", lambda combo: combo[0]), ("draft_quant", lambda combo: combo[1])):
                options = sorted({of(combo).quantization for combo in combos}, key=_quantization_order)
                self.controls[name].options = options
                self.controls[name].value = tuple(options)
            known = [draft.memory_bytes(self.context) / 2**20 for _, draft, _ in combos if draft.weight_bytes]
            top = max(1.0, 1.25 * max(known, default=1024.0))
            budget = self.controls["budget_mib"]
            budget.max, budget.step = round(top, 1), round(top / 20, 1)
            budget.min, budget.value = 0.0, budget.max
        finally:
            self._syncing = False

    def _on_target(self, *_):
        self._sync_choices()
        self.update()

    def selected(self) -> list[tuple]:
        """The (target, draft, reference) combos the quantization pickers let through."""
        c = self.controls
        return [combo for combo in self.groups[c["target"].value]
                if combo[0].quantization in c["target_quant"].value and combo[1].quantization in c["draft_quant"].value]

    def predictions(self):
        """The predicted frame for the current controls (raises with the reason when it cannot)."""
        c = self.controls
        if not c["target_quant"].value or not c["draft_quant"].value:
            raise ValueError("no quantization picked: pick at least one target and one draft quantization")

        def points(reference):
            return operating_points(reference, rtts_ms=c["rtts"].value, local="local" in c["place"].value,
                                    remote="remote" in c["place"].value, clients=(c["clients"].value,))

        prices = Prices(target_usd_per_hour=c["usd_hour"].value, usd_per_gb_down=c["usd_gb"].value)
        budget = None if c["budget_mib"].value >= c["budget_mib"].max else c["budget_mib"].value * 2**20
        return variants_frame(self.selected(), points, prices, Power(), self.context, c["objective"].value, budget)

    def update(self, *_):
        """Redraw the panel; on any failure the panel says what went wrong and which control to change."""
        if self._syncing:
            return self.frame
        c = self.controls
        try:
            if not c["rtts"].value and "remote" in c["place"].value:
                raise ValueError("remote is chosen but no RTT is: pick at least one RTT")
            frame = self.predictions()
            objective, column = c["objective"].value, cost_column(c["objective"].value)
            best = recommend(frame, c["cs"].value, objective)
            picks = {name: recommend(frame, value, objective)["label"] for name, value in PRESETS.items()}
            over = int((~frame["fits"]).sum())
            self.message = cs_summary(cs_ranges(frame, objective)) + (
                f"\n{over} points over the draft memory budget ({c['budget_mib'].value:g} MiB) are greyed and "
                f"never recommended" if over else "")
            replace_output(self.output,
                           pareto_figure(frame, cost=column, recommended=best, by="variant",
                                         title=f"{c['target'].value}<br>recommended at cs={c['cs'].value:g}: "
                                               f"{best['label']}"),
                           self.message, f"recommended per preset: {picks}",
                           frame[["label", "tokens_per_s", "aggregate_tokens_per_s", column, "draft_memory_bytes",
                                  "fits", "on_front"]].sort_values("tokens_per_s", ascending=False).round(4))
        except Exception as error:  # every failure reaches the panel, never only the log console
            self.frame, self.message = None, f"cannot draw this view: {type(error).__name__}: {error}"
            replace_output(self.output, self.message)
            return None
        self.frame = frame
        return frame


def _quantization_order(name: str) -> int:
    return QUANTIZATIONS.index(name) if name in QUANTIZATIONS else len(QUANTIZATIONS)
