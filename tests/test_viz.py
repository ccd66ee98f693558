"""Prediction frames, Plotly figures and the HTML Pareto report, from synthetic profiles (no model)."""
import pandas as pd
import pytest

from specbench.cli import main
from specbench.plan.explore import measured_points, operating_points, prediction_frame, recommend
from specbench.plan.library import save_profile, save_reference
from specbench.plan.predict import AcceptanceReference, LatencyProfile
from specbench.viz.figures import acceptance_figure, pareto_figure, time_breakdown_figure
from specbench.viz.report import write_pareto_report

TARGET = LatencyProfile("big", "test-device", rows=tuple((t, c, 0.10 + 0.004 * t + c * 1e-5)
                                                         for t in (1, 2, 4, 8, 16, 32) for c in (128, 512)))
DRAFT = LatencyProfile("small", "test-device", rows=tuple((t, c, 0.01 + 0.001 * t) for t in (1, 2, 4, 8)
                                                          for c in (128, 512)))
REFERENCE = AcceptanceReference("small", "big", "synthetic", max_chain=6,
                                chain_accepts=(0, 1, 2, 3, 4, 5, 6, 6, 2, 1),
                                tree_accepts={8: (2, 3, 4, 3), 16: (3, 4, 5, 4)},
                                tree_depth={8: 4.0, 16: 5.0}, tree_width={8: 4, 16: 4})


def frame():
    return prediction_frame(TARGET, DRAFT, REFERENCE, operating_points(REFERENCE, rtts_ms=(50,), remote=True))


def test_prediction_frame_covers_every_point_and_marks_the_true_front():
    predicted = frame()
    assert len(predicted) == 2 * (1 + 6 + 2)  # local and remote x (target-only, K=1..6, two budgets)
    cost = "total_cost_usd_per_mtok"
    for _, row in predicted.iterrows():
        dominated = ((predicted["tokens_per_s"] >= row["tokens_per_s"]) & (predicted[cost] <= row[cost])
                     & ((predicted["tokens_per_s"] > row["tokens_per_s"]) | (predicted[cost] < row[cost]))).any()
        assert row["on_front"] == (not dominated)


def test_recommendation_moves_from_speed_to_cost_with_cs():
    predicted = frame()
    assert recommend(predicted, 0.0)["tokens_per_s"] == predicted["tokens_per_s"].max()
    assert recommend(predicted, 1.0)["total_cost_usd_per_mtok"] == predicted["total_cost_usd_per_mtok"].min()


def test_pareto_figure_has_predicted_front_and_measured_traces():
    predicted = frame()
    measured = predicted.head(3).assign(tokens_per_s=lambda f: f["tokens_per_s"] * 0.9)
    figure = pareto_figure(predicted, measured, recommended=recommend(predicted, 0.5))
    names = [trace.name for trace in figure.data]
    assert {"predicted: chain", "predicted: tree", "predicted: target-only", "Pareto front (predicted)",
            "measured", "recommended"} <= set(names)
    plotted = sum(len(t.x) for t in figure.data if t.name.startswith("predicted:"))
    assert plotted == len(predicted)
    front = next(t for t in figure.data if t.name == "Pareto front (predicted)")
    assert len(front.x) == int(predicted["on_front"].sum())


def records():
    rows = []
    for method, k, accepted in (("target-only", 0, [0, 0, 0]), ("chain", 4, [4, 1, 2])):
        for step, a in enumerate(accepted):
            rows.append({"method": method, "kind": "none" if k == 0 else "chain", "planned": False, "k": k,
                         "drafted": k, "accepted": a, "emitted": a + 1, "draft_s": 0.01 * k, "verify_s": 0.1,
                         "network_s": 0.0, "step_s": 0.12 + 0.01 * k, "overhead_s": 0.02, "bytes_up": 0,
                         "bytes_down": 0})
    return pd.DataFrame(rows)


def test_record_figures_and_measured_points():
    data = records()
    acceptance = acceptance_figure(data)
    assert [t.name for t in acceptance.data] == ["chain"]
    assert list(acceptance.data[0].y) == [1.0, 2 / 3, 1 / 3, 1 / 3]
    breakdown = time_breakdown_figure(data)
    assert [t.name for t in breakdown.data] == ["draft", "network", "verify", "overhead"]
    measured = measured_points(data)
    assert list(measured["label"]) == ["target-only (local)", "chain K=4 (local)"]
    assert measured.iloc[1]["tokens_per_step"] == pytest.approx(10 / 3)  # emitted 5, 2, 3


def test_measured_points_split_the_targets_time_between_the_rows_of_each_round():
    """At several clients a round's seconds are shared by its own rows (its `batch_size`), not by every client:
    4 clients whose rounds held 1 and 3 rows cost what those rounds took per token, as a prediction prices it."""
    from specbench.plan.costs import Prices

    rows = [{"method": "chain", "kind": "chain", "k": 2, "planned": False, "drafted": 2, "accepted": 1, "emitted": 2,
             "draft_s": 0.0, "verify_s": seconds, "network_s": 0.0, "step_s": 0.5, "overhead_s": 0.0, "bytes_up": 0,
             "bytes_down": 0, "batch_size": batch} for seconds, batch in [(0.1, 1)] + [(0.3, 3)] * 3]
    data = pd.DataFrame(rows)
    prices = Prices()
    measured = measured_points(data, prices=prices, clients=4).iloc[0]
    # the target was busy 0.1 + 0.3 s for the 8 tokens of the four steps
    per_token = prices.target_usd_per_hour / 3600 * 0.4 / 8 * 1e6
    assert measured["api_cost_usd_per_mtok"] == pytest.approx(per_token)
    assert measured["aggregate_tokens_per_s"] == pytest.approx(4 * 8 / 2.0)
    alone = measured_points(data.assign(batch_size=1), prices=prices, clients=1).iloc[0]
    assert alone["api_cost_usd_per_mtok"] == pytest.approx(prices.target_usd_per_hour / 3600 * 1.0 / 8 * 1e6)


def test_measured_points_bill_drafting_to_the_device_that_drafts():
    """A local run's drafting held the machine the target is priced on; a remote run's client drafted on its own
    device (its energy priced instead), unless the method drafts on the worker."""
    from specbench.plan.costs import Power, Prices

    prices, power = Prices(usd_per_gb_down=0.0), Power()
    data = records()
    chain = data[data["method"] == "chain"]
    tokens, drafting, verifying = chain["emitted"].sum(), chain["draft_s"].sum(), chain["verify_s"].sum()
    per_s = prices.target_usd_per_hour / 3600 * 1e6
    local = measured_points(data, prices=prices, power=power).iloc[1]
    remote = measured_points(data, prices=prices, power=power, where="remote", rtt_ms=10.0).iloc[1]
    assert local["api_cost_usd_per_mtok"] == pytest.approx(per_s * (drafting + verifying) / tokens)
    assert local["total_cost_usd_per_mtok"] == pytest.approx(local["api_cost_usd_per_mtok"])
    assert local["draft_energy_j_per_mtok"] == pytest.approx(power.target_watts * drafting / tokens * 1e6)
    assert remote["api_cost_usd_per_mtok"] == pytest.approx(per_s * verifying / tokens)
    assert remote["draft_energy_j_per_mtok"] == pytest.approx(power.draft_watts * drafting / tokens * 1e6)
    on_worker = measured_points(chain.assign(method="eagle-server"), prices=prices, power=power, where="remote").iloc[0]
    assert on_worker["api_cost_usd_per_mtok"] == pytest.approx(local["api_cost_usd_per_mtok"])


def test_report_and_cli_write_html_from_cached_files(tmp_path, capsys):
    path = write_pareto_report(tmp_path / "r.html", [{"title": "synthetic", "predicted": frame(), "cs": 0.5}])
    page = path.read_text()
    assert "plotly" in page and "Recommended operating point per preset" in page and "synthetic" in page
    save_profile(TARGET, folder=tmp_path / "p")
    save_profile(DRAFT, folder=tmp_path / "p")
    save_reference(REFERENCE, folder=tmp_path / "ref")
    out = tmp_path / "cli.html"
    assert main(["pareto", "--profiles", str(tmp_path / "p"), "--references", str(tmp_path / "ref"),
                 "--out", str(out), "--rtt", "50"]) == 0
    page = out.read_text()  # the view names its profiles' origin: the user's own, from this sitting
    assert out.exists() and "big (test-device, float32, synthetic) · own, " in page and ": drafts small" in page
    assert main(["pareto", "--profiles", str(tmp_path / "p"), "--references", str(tmp_path / "ref"),
                 "--out", str(out), "--cs", "1.5"]) == 2
    assert "cs must be in [0, 1]" in capsys.readouterr().err
    assert main(["pareto", "--profiles", str(tmp_path / "empty"), "--references", str(tmp_path / "ref"),
                 "--out", str(out)]) == 2


def test_token_sources_split_accepted_draft_from_bonus():
    from specbench.viz.text import colored_text_html, token_sources

    data = pd.DataFrame([{"method": "chain", "prompt_index": 0, "step": 0, "accepted": 2, "emitted_tokens": [5, 6, 7]},
                         {"method": "chain", "prompt_index": 0, "step": 1, "accepted": 0, "emitted_tokens": [8]}])
    assert token_sources(data, "chain") == [(5, "draft"), (6, "draft"), (7, "target"), (8, "target")]

    class Letters:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

    page = colored_text_html(data, Letters(), "chain")
    assert page.count("title='draft'") == 2 and page.count("title='target'") == 2 and ">e</span>" in page


def test_replace_output_fills_a_panel_as_data():
    import ipywidgets

    from specbench.viz.panels import replace_output

    panel = ipywidgets.Output()
    replace_output(panel, pareto_figure(frame()), "first")
    replace_output(panel, pareto_figure(frame()), frame().head(2), "recommended: x")
    figure, table, text = panel.outputs  # replaced, not appended
    assert "application/vnd.plotly.v1+json" in figure["data"]
    assert table["output_type"] == "display_data" and "text/plain" in table["data"]
    assert text == {"output_type": "stream", "name": "stdout", "text": "recommended: x\n"}
