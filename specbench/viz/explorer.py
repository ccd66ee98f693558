"""Notebook 03's Pareto explorer: its controls, and a panel that every control redraws or explains.

Why a module: the notebook is what users see, but its behaviour must be testable control by
control (a control that fails, or that changes nothing in the current view, must say so in the
panel, not in JupyterLab's log console). The panel is the one place messages appear.

Rules the panel states: the recommendation is the shown point (within the draft memory budget)
with the lowest AutoDraft J = cs * cost / C + (1 - cs) * T / tokens_per_s, T and C being
target-only's (`plan.predict.choose`), so it depends only on the objective, cs and the points
shown; the draft memory budget belongs to the user's device, not to a target, so it stays
unlimited until the user sets one, whatever target is picked.
"""
from __future__ import annotations

from typing import Optional, Sequence

import ipywidgets as widgets

from specbench.plan.costs import Power, Prices, PRESETS
from specbench.models.spec import QUANTIZATIONS
from specbench.plan.explore import (cost_column, cs_ranges, cs_summary, draft_quantization, operating_points, recommend,
                                    variants_frame)
from specbench.plan.objectives import OBJECTIVES as OBJECTIVE_TABLE
from specbench.viz.figures import pareto_figure
from specbench.viz.panels import replace_output


RTT_CHOICES_MS = (5.0, 10.0, 25.0, 50.0, 100.0, 200.0)
RULE = ("rule: the recommendation is the shown point within the memory budget with the lowest "
        "J = cs x cost / cost(target-only) + (1 - cs) x speed(target-only) / speed")


class ParetoExplorer:
    """Pick a target family (all its cached drafts and quantizations), which target and draft quantizations
    to show, the draft device's memory budget, places, RTTs, prices, clients, cost objective and weight
    `cs`; the panel shows the Pareto figure coloured by draft/quantization, what the current view ignores
    and why, the recommendation per preset, how it moves with cs, and the table.

    `groups` maps a title to its (target profile, draft profile, reference) combos (`target_groups`).
    After every change `frame` holds the predictions drawn, or None with `message` saying why not;
    `notes` lists the controls the view ignores, each with its reason.
    """

    def __init__(self, groups: dict, group: Optional[str] = None, places: Sequence[str] = ("local", "remote"),
                 rtts_ms: Sequence[float] = (10.0, 50.0, 100.0), cs: float = 0.5, objective: str = "total_cost",
                 clients: int = 1, target_usd_per_hour: float = 2.0, usd_per_gb_down: float = 0.09,
                 context: int = 256, budget_mib: Optional[float] = None):
        if not groups:
            raise ValueError("no cached pairs: run notebook 05 or `specbench profile` / `specbench reference`")
        self.groups, self.context, self._syncing = groups, context, False
        wide = widgets.Layout(width="95%")
        self.controls = {
            "target": widgets.Dropdown(options=list(groups), value=group or next(iter(groups)), description="target",
                                       layout=wide),
            "target_quant": widgets.SelectMultiple(description="target quant", style={"description_width": "initial"}),
            "draft_quant": widgets.SelectMultiple(description="draft quant", style={"description_width": "initial"}),
            "limit_memory": widgets.Checkbox(value=budget_mib is not None, description="limit draft memory",
                                             tooltip="the draft device's memory: weights + a cache of the context"),
            "budget_mib": widgets.BoundedFloatText(value=budget_mib or 1024.0, min=1.0, max=1e7, step=64.0,
                                                   description="draft MiB", disabled=budget_mib is None),
            "place": widgets.SelectMultiple(options=["local", "remote"], value=tuple(places), description="place"),
            "rtts": widgets.SelectMultiple(options=sorted({*RTT_CHOICES_MS, *rtts_ms}), value=tuple(rtts_ms),
                                           description="RTT ms"),
            "usd_hour": widgets.FloatSlider(value=target_usd_per_hour, min=0.1, max=10, step=0.1,
                                            description="target $/h"),
            "usd_gb": widgets.FloatSlider(value=usd_per_gb_down, min=0, max=0.5, step=0.01, description="$/GB down"),
            "cs": widgets.FloatSlider(value=cs, min=0, max=1, step=0.05, description="cs"),
            "objective": widgets.Dropdown(options=tuple(OBJECTIVE_TABLE), value=objective, description="cost"),
            "clients": widgets.IntSlider(value=clients, min=1, max=16, description="clients",
                                         tooltip="concurrent clients sharing the remote target (batched verification)"),
        }
        self.output = widgets.Output(layout=widgets.Layout(width="100%"))
        self.frame, self.message, self.notes = None, "", []
        self._sync_choices()
        self.controls["target"].observe(self._on_target, names="value")
        self.controls["limit_memory"].observe(self._on_limit, names="value")
        for name, control in self.controls.items():
            if name not in ("target", "limit_memory"):
                control.observe(self.update, names="value")

    @property
    def view(self) -> widgets.VBox:
        c = self.controls
        return widgets.VBox([c["target"], widgets.HBox([c["target_quant"], c["draft_quant"]]),
                             widgets.HBox([c["limit_memory"], c["budget_mib"]]),
                             widgets.HBox([c["place"], c["rtts"]]), widgets.HBox([c["usd_hour"], c["usd_gb"]]),
                             widgets.HBox([c["cs"], c["objective"]]), c["clients"], self.output])

    def _sync_choices(self) -> None:
        """The quantization pickers offer exactly what the chosen family's caches hold, all picked; each
        picker's options and value go to the browser in one message (apart, the browser applied a value
        to the old options: "Cannot set properties of undefined")."""
        self._syncing = True
        try:
            combos = self.groups[self.controls["target"].value]
            quantizations = (("target_quant", lambda combo: combo[0].quantization),
                             ("draft_quant", lambda combo: draft_quantization(combo[1])))
            for name, of in quantizations:
                control = self.controls[name]
                options = sorted({of(combo) for combo in combos}, key=_quantization_order)
                with control.hold_sync():
                    control.options = options
                    control.value = tuple(options)
                    control.disabled = len(options) == 1
        finally:
            self._syncing = False

    def _on_target(self, *_):
        self._sync_choices()
        self.update()

    def _on_limit(self, change):
        self.controls["budget_mib"].disabled = not change["new"]
        self.update()

    def selected(self) -> list[tuple]:
        """The (target, draft, reference) combos the quantization pickers let through."""
        c = self.controls
        return [combo for combo in self.groups[c["target"].value]
                if combo[0].quantization in c["target_quant"].value
                and draft_quantization(combo[1]) in c["draft_quant"].value]

    def budget_bytes(self) -> Optional[float]:
        c = self.controls
        return c["budget_mib"].value * 2**20 if c["limit_memory"].value else None

    def predictions(self):
        """The predicted frame for the current controls (raises with the reason when it cannot)."""
        c = self.controls
        if not c["target_quant"].value or not c["draft_quant"].value:
            raise ValueError("no quantization picked: pick at least one target and one draft quantization")

        def points(reference):
            return operating_points(reference, rtts_ms=c["rtts"].value, local="local" in c["place"].value,
                                    remote="remote" in c["place"].value, clients=(c["clients"].value,))

        prices = Prices(target_usd_per_hour=c["usd_hour"].value, usd_per_gb_down=c["usd_gb"].value)
        return variants_frame(self.selected(), points, prices, Power(), self.context, c["objective"].value,
                              self.budget_bytes())

    def inactive(self, frame=None) -> list[str]:
        """Each control the current view ignores, with why (so no control does nothing silently); each
        note starts with the control's label."""
        c, notes = self.controls, []
        objective, remote = c["objective"].value, "remote" in c["place"].value
        if c["target_quant"].disabled:
            notes.append(f"target quant: only {c['target_quant'].options[0]!r} has a reference for this target "
                         f"(record one with a quantized target to compare)")
        if c["draft_quant"].disabled:
            notes.append(f"draft quant: only {c['draft_quant'].options[0]!r} is cached for this target's drafts")
        if OBJECTIVE_TABLE[objective].unit != "$":
            notes.append(f"target $/h and $/GB down price api_cost and total_cost; {objective} counts "
                         f"{OBJECTIVE_TABLE[objective].unit} only")
        elif objective == "api_cost":
            notes.append("$/GB down prices bytes on the wire, which only total_cost counts")
        if not remote:
            notes.append("RTT ms and clients apply to remote points; pick place 'remote' to see them")
        elif objective == "draft_energy":
            notes.append("clients share the remote target's forwards: they move speed and target cost, not the "
                         "draft's joules per token")
        if not c["limit_memory"].value:
            notes.append("draft MiB: no limit set (tick 'limit draft memory' to grey out drafts over it)")
        elif frame is not None and frame["fits"].all():
            notes.append(f"draft MiB: every shown draft fits in {c['budget_mib'].value:g} MiB, so nothing is greyed")
        return notes

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
            self.notes = self.inactive(frame)
            self.message = cs_summary(cs_ranges(frame, objective)) + (
                f"\n{over} points over the draft memory budget ({c['budget_mib'].value:g} MiB) are greyed and "
                f"never recommended" if over else "")
            notes = "\n".join(f"- {note}" for note in self.notes)
            replace_output(self.output,
                           pareto_figure(frame, cost=column, recommended=best, by="variant",
                                         title=f"{c['target'].value}<br>recommended at cs={c['cs'].value:g}: "
                                               f"{best['label']}"),
                           self.message, f"recommended per preset: {picks}\n{RULE}",
                           *([f"not used in this view:\n{notes}"] if notes else []),
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
