"""Notebook 03's explorer: every control, set to each of its values through the widget objects in the
notebook's own kernel, redraws the panel or says in it why not; cost weights that matter and ones that
do not are told apart; objectives that are zero at target-only are chosen from, not refused."""
from pathlib import Path

import pytest

from specbench.plan.explore import cs_ranges, cs_summary, operating_points, prediction_frame, recommend
from specbench.plan.predict import AcceptanceReference, LatencyProfile
from test_viz import DRAFT, REFERENCE, TARGET

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# Appended to notebook 03 and run in its kernel after its own cells.
SWEEP = '''
import itertools
import json
import ipywidgets as widgets

def values_of(control):
    # every option and pair of options, and all of them; sliders at 11 stops from end to end (every
    # 0.1 of $/hour redrew the same view 100 times and cost CI a minute)
    if isinstance(control, widgets.SelectMultiple):
        options = list(control.options)
        sizes = sorted({0, 1, 2, len(options)} & set(range(len(options) + 1)))
        return [tuple(c) for n in sizes for c in itertools.combinations(options, n)]
    if isinstance(control, (widgets.FloatSlider, widgets.IntSlider)):
        count = int(round((control.max - control.min) / control.step))
        stops = sorted({round(i * count / 10) for i in range(11)})
        return [round(control.min + i * control.step, 6) for i in stops]
    if isinstance(control, widgets.Checkbox):
        return [not control.value, control.value]
    if isinstance(control, widgets.BoundedFloatText):
        return [50.0, 300.0, 1000.0, 100000.0]
    return list(control.options)

def figure():
    panel = explorer.output.outputs
    return json.dumps(panel[0].get("data"), sort_keys=True) if panel and "data" in panel[0] else None

LABELS = {"limit_memory": "draft MiB"}  # the checkbox's notes speak of the budget it enables
checked, refused, explained = 0, [], 0
for name, control in explorer.controls.items():
    start = control.value
    for value in values_of(control):
        if value == control.value:
            continue
        before = figure()
        explorer.output.outputs = ()
        control.value = value
        checked += 1
        panel = explorer.output.outputs
        assert panel, f"{name}={value!r} left the panel empty"
        if explorer.frame is None:
            assert panel[0]["text"].startswith("cannot draw this view:"), (name, value, panel)
            refused.append((name, value, explorer.message))
            continue
        kinds = [next(iter(entry["data"]), None) if "data" in entry else "text" for entry in panel]
        assert kinds[0] == "application/vnd.plotly.v1+json" and "text" in kinds, (name, value, kinds)
        assert explorer.message.startswith(("recommended by cs", "the cost weight changes nothing")), explorer.message
        if figure() == before:  # nothing drawn changed: the panel must say why this control does nothing here
            label = LABELS.get(name, control.description)
            assert any(note.startswith(label) or label in note for note in explorer.notes), (name, value, explorer.notes)
            explained += 1
    control.value = start
print("checked", checked, "refused", refused, "explained", explained)
# Only empty selections are refused, each with its reason in the panel.
assert {(name, value) for name, value, _ in refused} <= {("place", ()), ("rtts", ()), ("target_quant", ()),
                                                         ("draft_quant", ())}, refused
assert all(any(reason in m for reason in ("choose local, remote or both", "pick at least one RTT",
                                          "pick at least one target and one draft quantization"))
           for _, _, m in refused), refused
# The pickers offer exactly the quantizations the caches hold for each target.
for title, combos in groups.items():
    explorer.controls["target"].value = title
    assert set(explorer.controls["target_quant"].options) == {t.quantization for t, _, _ in combos}
    assert set(explorer.controls["draft_quant"].options) == {d.quantization if d else "none" for _, d, _ in combos}
    assert set(explorer.frame["draft"]) - {None} <= {draft_name(d, r) for _, d, r in combos}
assert checked >= 100, checked  # every control: each option, pair and all; 11 stops a slider
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


def _variant(quantization: str, weight_mib: float, speedup: float):
    """A synthetic quantized twin of DRAFT: `speedup` times faster, `weight_mib` of weights."""
    rows = tuple((t, c, s / speedup) for t, c, s in DRAFT.rows)
    label = "small" if quantization == "none" else f"small@{quantization}"
    profile = LatencyProfile(label, "test-device", quantization=quantization, rows=rows,
                             weight_bytes=int(weight_mib * 2**20), kv_bytes_per_token=1024)
    reference = AcceptanceReference(label, "big", "synthetic", max_chain=6, chain_accepts=REFERENCE.chain_accepts)
    return TARGET, profile, reference


def test_variants_share_one_frame_and_a_draft_over_budget_is_shown_not_dropped():
    from specbench.plan.explore import variants_frame

    combos = [_variant("none", 400, 1.0), _variant("8bit", 150, 1.3), _variant("4bit", 90, 1.1)]
    points = lambda reference: operating_points(reference, chain_ks=(2, 4))
    everything = variants_frame(combos, points)
    assert everything["label"].is_unique
    assert (everything["method"] == "target-only").sum() == 1  # one target variant: one target-only row
    assert set(everything["draft_quantization"]) == {"none", "8bit", "4bit"} and everything["fits"].all()
    budget = 200 * 2**20  # the fp32 draft (400 MiB + 256 tokens x 1 KiB) does not fit
    limited = variants_frame(combos, points, draft_budget_bytes=budget)
    assert len(limited) == len(everything)
    over = limited[~limited["fits"]]
    assert set(over["draft"]) == {"small"} and (over["draft_memory_bytes"] > budget).all()
    assert not over["on_front"].any()
    assert recommend(limited[limited["fits"]], 0.0)["draft"] != "small"
    assert recommend(limited, 0.0)["draft"] != "small"  # recommend itself never picks an over-budget point


def test_the_fastest_point_over_the_budget_is_never_recommended():
    from specbench.plan.explore import cs_ranges, variants_frame
    from specbench.plan.predict import choose

    combos = [_variant("none", 400, 2.0), _variant("8bit", 150, 1.3)]  # the fp32 draft is fastest, too big
    frame = variants_frame(combos, lambda reference: operating_points(reference, chain_ks=(2, 4)),
                           draft_budget_bytes=200 * 2**20)
    fastest = frame.loc[frame["tokens_per_s"].idxmax()]
    assert fastest["draft"] == "small" and not fastest["fits"]
    assert choose(frame.to_dict("records"), 0.0, cost="total_cost_usd_per_mtok")["draft"] == "small"  # unfiltered
    assert recommend(frame, 0.0)["draft"] == "small@8bit"
    assert not cs_ranges(frame)["label"].str.startswith("small:").any()


def test_a_profile_of_another_quantization_than_the_reference_is_refused():
    from specbench.types import SpecbenchError

    target, draft_8bit, _ = _variant("8bit", 150, 1.3)
    _, _, reference_4bit = _variant("4bit", 90, 1.1)
    with pytest.raises(SpecbenchError, match="reference measured draft 'small@4bit' but the draft profile is of "
                                             "'small@8bit'"):
        prediction_frame(target, draft_8bit, reference_4bit)


def test_memory_round_trips_through_the_profile_cache(tmp_path):
    from specbench.plan.library import load_profiles, save_profile

    _, profile, _ = _variant("int8-dynamic", 120, 2.0)
    path = save_profile(profile, folder=tmp_path)
    assert "small-int8-dynamic" in path.name
    [loaded] = load_profiles(tmp_path)
    assert loaded == profile and loaded.memory_bytes(1000) == profile.weight_bytes + 1000 * 1024


def test_pareto_command_greys_drafts_over_the_memory_budget(tmp_path, capsys):
    from specbench.cli import main
    from specbench.plan.library import save_profile, save_reference

    for quantization, mib, speedup in (("none", 400, 1.0), ("4bit", 90, 1.1)):
        target, draft, reference = _variant(quantization, mib, speedup)
        save_profile(draft, folder=tmp_path / "p")
        save_reference(reference, folder=tmp_path / "r")
    save_profile(TARGET, folder=tmp_path / "p")
    out = tmp_path / "report.html"
    assert main(["pareto", "--profiles", str(tmp_path / "p"), "--references", str(tmp_path / "r"), "--out", str(out),
                 "--draft-budget-mib", "200"]) == 0
    printed = capsys.readouterr().out
    assert "drafts small, small@4bit" in printed and "points over the draft memory budget" in printed
    assert "does not fit the draft memory budget" in out.read_text()


@pytest.mark.parametrize("objective", ["draft_energy", "total_cost", "api_cost", "target_energy"])
def test_hiding_a_draft_that_is_not_recommended_never_moves_the_recommendation(objective):
    """Notebook 03's recommendation moved when unrelated drafts were shown or hidden: a draft-energy
    objective is zero at target-only and was scaled by the largest cost among the points shown. Now
    each point's J depends on that point and target-only only (`plan.predict.choose`)."""
    from specbench.plan.explore import variants_frame

    combos = [_variant("none", 400, 1.0), _variant("8bit", 150, 1.3), _variant("4bit", 90, 0.6)]
    points = lambda reference: operating_points(reference, chain_ks=(1, 2, 4, 6))  # noqa: E731
    for cs in (0.0, 0.3, 0.5, 0.7, 1.0):
        every = recommend(variants_frame(combos, points, cost=objective), cs, objective)["label"]
        for hidden in range(len(combos)):
            shown = [combo for index, combo in enumerate(combos) if index != hidden]
            if every.startswith(f"{combos[hidden][1].model}:"):
                continue  # hiding the recommended draft may move it, by definition
            assert recommend(variants_frame(shown, points, cost=objective), cs, objective)["label"] == every, (
                cs, hidden)


def test_an_own_profile_never_pairs_with_a_shipped_one_silently():
    """A user's own fp32 profile (busy box, today) was paired with the shipped 8-bit one (another day)
    under the shipped view's title. Now a target pairs only with drafts of its origin and sitting, views
    are titled with their origin, and `mix_origins` is the user's explicit choice."""
    from dataclasses import replace

    from specbench.plan.explore import matching_pairs, target_groups

    shipped_target, shipped_draft = (replace(p, origin="shipped", sitting="2026-11-23 vm") for p in (TARGET, DRAFT))
    own_target = replace(TARGET, origin="own", sitting="2026-11-25 box", noise=0.45)
    own_draft = replace(DRAFT, origin="own", sitting="2026-11-25 box")
    other_sitting = replace(DRAFT, origin="own", sitting="2026-11-20 box")
    pairs = lambda profiles, **kw: {(t.origin, t.sitting, d.origin, d.sitting)  # noqa: E731
                                    for t, d, _ in matching_pairs(profiles, [REFERENCE], **kw)}
    assert pairs([own_target, shipped_draft]) == set()
    assert pairs([shipped_target, own_draft]) == set()
    assert pairs([own_target, other_sitting]) == set()
    assert pairs([own_target, own_draft, shipped_target, shipped_draft, other_sitting]) == {
        ("own", "2026-11-25 box", "own", "2026-11-25 box"), ("shipped", "2026-11-23 vm", "shipped", "2026-11-23 vm")}
    assert pairs([own_target, shipped_draft], mix_origins=True) == {("own", "2026-11-25 box", "shipped", "2026-11-23 vm")}
    titles = list(target_groups(matching_pairs([own_target, own_draft, shipped_target, shipped_draft], [REFERENCE])))
    assert sorted(titles) == ["big (test-device, float32, synthetic) · own, 2026-11-25 box · busy machine: spread 0.45",
                              "big (test-device, float32, synthetic) · shipped"], titles


def test_loaded_records_know_their_origin_and_a_noisy_profile_is_flagged(tmp_path):
    import warnings

    from dataclasses import replace

    from specbench.plan.library import PROFILES, load_profiles, save_profile
    from specbench.record import spread

    rows = [{"median_s": 0.051, "min_s": 0.050, "max_s": 0.053}, {"median_s": 0.09, "min_s": 0.08, "max_s": 0.14}]
    assert spread(rows) == pytest.approx((0.06 + 0.6667) / 2, abs=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_profile(replace(TARGET, noise=0.45), folder=tmp_path)
    assert any("busy" in str(w.message) for w in caught)
    [own] = load_profiles(tmp_path)
    assert own.origin == "own" and own.noise == 0.45 and own.sitting
    assert {p.origin for p in load_profiles(PROFILES)} == {"shipped"}


def test_prompt_lookup_and_suffix_join_their_targets_view_priced_with_free_drafting():
    """`free_drafts`: prompt lookup's and suffix decoding's references (no draft profile) join the view of the
    target profile a model draft pairs with on their prompt set, priced as the predictor prices them alone
    (drafting free, no draft memory); the explorer offers them under draft quant "none" and can recommend
    them; without `free_drafts` nothing changes."""
    from specbench.plan.explore import matching_pairs, target_groups, variants_frame
    from specbench.viz.explorer import ParetoExplorer

    steps = {4: ((4, 3), (4, 4), (2, 2), (0, 0), (4, 1))}
    lookup = AcceptanceReference("prompt-lookup", "big", "synthetic", max_chain=4, chain_accepts=(3, 4, 1),
                                 steps_at_k=steps)
    suffix = AcceptanceReference("suffix", "big", "synthetic", max_chain=4, chain_accepts=(4, 4),
                                 steps_at_k={4: ((4, 4), (4, 4), (3, 3))})
    elsewhere = AcceptanceReference("prompt-lookup", "big", "other-set", max_chain=4, chain_accepts=(2,))
    references = [REFERENCE, lookup, suffix, elsewhere]
    assert matching_pairs([TARGET, DRAFT], references) == [(TARGET, DRAFT, REFERENCE)]
    pairs = matching_pairs([TARGET, DRAFT], references, free_drafts=True)
    assert pairs[:1] == [(TARGET, DRAFT, REFERENCE)]
    assert (TARGET, None, lookup) in pairs and (TARGET, None, suffix) in pairs
    assert (TARGET, None, elsewhere) in pairs  # no model pair on its prompt set: every profile of its target
    groups = target_groups(pairs)
    assert len(groups) == 2 and [len(combos) for combos in groups.values()] == [3, 1]
    combos = next(iter(groups.values()))
    points = lambda reference: operating_points(reference, chain_ks=(2, 4))  # noqa: E731
    frame = variants_frame(combos, points)
    alone = prediction_frame(TARGET, None, lookup, points(lookup)).set_index("label")
    free = frame[frame["draft"] == "prompt-lookup"]
    assert set(free["label"]) == {f"prompt-lookup: chain K={k} (local)" for k in (2, 4)}
    assert (free["draft_memory_bytes"] == 0).all() and free["fits"].all()
    for k in (2, 4):
        got = free.set_index("label").loc[f"prompt-lookup: chain K={k} (local)", "tokens_per_s"]
        assert got == pytest.approx(alone.loc[f"chain K={k} (local)", "tokens_per_s"])
    assert set(frame["draft"]) == {"small", "prompt-lookup", "suffix"} and frame["label"].is_unique
    explorer = ParetoExplorer(groups, places=("local",))
    assert explorer.controls["draft_quant"].options == ("none",)
    explorer.controls["cs"].value = 0.0
    assert explorer.frame is not None and recommend(explorer.frame, 0.0)["draft"] == "suffix"  # 4.4 tokens a step
