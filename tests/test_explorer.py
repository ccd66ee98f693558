"""Notebook 03's explorer: every control, set to each of its values through the widget objects in the
notebook's own kernel, redraws the panel or says in it why not; cost weights that matter and ones that
do not are told apart; objectives that are zero at target-only are chosen from, not refused."""
from pathlib import Path

import pytest

from specbench.plan.explore import cs_ranges, cs_summary, operating_points, prediction_frame, recommend
from test_viz import DRAFT, REFERENCE, TARGET

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# Appended to notebook 03 and run in its kernel after its own cells.
SWEEP = '''
import itertools
import ipywidgets as widgets

def values_of(control):
    if isinstance(control, widgets.SelectMultiple):
        options = list(control.options)
        return [tuple(c) for n in range(len(options) + 1) for c in itertools.combinations(options, n)]
    if isinstance(control, (widgets.FloatSlider, widgets.IntSlider)):
        count = int(round((control.max - control.min) / control.step))
        return [round(control.min + i * control.step, 6) for i in range(count + 1)]
    return list(control.options)

checked, refused = 0, []
for name, control in explorer.controls.items():
    start = control.value
    for value in values_of(control):
        if value == control.value:
            continue
        explorer.output.outputs = ()
        control.value = value
        checked += 1
        panel = explorer.output.outputs
        assert panel, f"{name}={value!r} left the panel empty"
        if explorer.frame is None:
            assert panel[0]["text"].startswith("cannot draw this view:"), (name, value, panel)
            refused.append((name, value, explorer.message))
        else:
            kinds = [next(iter(entry["data"]), None) if "data" in entry else "text" for entry in panel]
            assert kinds[0] == "application/vnd.plotly.v1+json" and "text" in kinds, (name, value, kinds)
            assert explorer.message.startswith(("recommended by cs", "the cost weight changes nothing")), explorer.message
    control.value = start
print("checked", checked, "refused", refused)
# Only empty selections are refused, each with its reason in the panel.
assert {(name, value) for name, value, _ in refused} == {("place", ()), ("rtts", ())}, refused
assert all("choose local, remote or both" in m or "pick at least one RTT" in m for _, _, m in refused), refused
assert checked > 150
'''


@pytest.mark.real_model
def test_every_control_of_notebook_03_updates_its_panel():
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(NOTEBOOKS / "03_pareto_explorer.ipynb", as_version=4)
    book.cells.append(nbformat.v4.new_code_cell(SWEEP))
    NotebookClient(book, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    printed = "".join(output.get("text", "") for output in book.cells[-1].outputs)
    assert "checked" in printed


def test_an_objective_zero_at_target_only_is_chosen_from_not_refused():
    frame = prediction_frame(TARGET, DRAFT, REFERENCE, operating_points(REFERENCE), cost="draft_energy")
    assert frame.loc[frame["method"] == "target-only", "draft_energy_j_per_mtok"].iloc[0] == 0
    assert recommend(frame, 1.0, "draft_energy")["method"] == "target-only"  # no draft energy at all
    assert recommend(frame, 0.0, "draft_energy")["tokens_per_s"] == frame["tokens_per_s"].max()
    spans = cs_ranges(frame, "draft_energy")
    assert len(spans) >= 2 and spans["cs_from"].iloc[0] == 0 and spans["cs_to"].iloc[-1] == 1
    assert cs_summary(spans).startswith("recommended by cs: 0-")


def test_a_view_where_one_point_is_fastest_and_cheapest_says_the_weight_does_not_matter():
    frame = prediction_frame(TARGET, DRAFT, REFERENCE, operating_points(REFERENCE))
    fastest = frame.loc[frame["tokens_per_s"].idxmax()]
    frame["total_cost_usd_per_mtok"] = 2.0
    frame.loc[fastest.name, "total_cost_usd_per_mtok"] = 1.0  # the fastest point is made the cheapest too
    spans = cs_ranges(frame, "total_cost")
    assert list(spans["label"]) == [fastest["label"]]
    assert "changes nothing" in cs_summary(spans)


def test_an_objective_that_is_zero_everywhere_leaves_speed_to_decide():
    frame = prediction_frame(TARGET, DRAFT, REFERENCE, operating_points(REFERENCE))
    frame["api_cost_usd_per_mtok"] = 0.0
    assert recommend(frame, 1.0, "api_cost")["tokens_per_s"] == frame["tokens_per_s"].max()
