"""`specbench tune` runs suffix decoding's hybrid with its best measured draft beside its best point, chooses on that
run, and writes the hybrid's budget for its draft where `run --config` and `serve --config` read it."""
import json

import pandas as pd
import pytest

from specbench.tune import TuneSpec, tune
from specbench.tune.hybrid import BUDGET, HYBRID_ONLY, KNOBS, beside_hybrid, hybrid_method, hybrid_point
from specbench.tune.spec import Candidate
from specbench.types import SpecbenchError

DRAFT = "tiny-random:seed=1,noise=0.005,noise_from=0"
PROMPTS = tuple([(i * 7 + j * 3) % 90 + 3 for j in range(12)] + [5, 6, 7, 8] * 3 for i in range(8))


def spec(**overrides) -> TuneSpec:
    settings = dict(target="tiny-random:seed=0", drafts=(DRAFT, "suffix"), prompts=PROMPTS, prompt_count=6,
                    chain_ks=(2, 4), max_new_tokens=12, budget_minutes=5, repeats=2, measure_share=0.0)
    settings.update(overrides)
    return TuneSpec(**settings)


def table(*points) -> pd.DataFrame:
    rows = [("target-only", "target-only", 0, 10.0, 1)] + list(points)
    return pd.DataFrame([dict(label=f"{c}: {m} K={k}" + (f" x{n}" if n > 1 else ""), candidate=c, method=m, k=k,
                              clients=n, measured_tokens_per_s=speed, total_cost_usd_per_mtok=100 / speed)
                         for c, m, k, speed, n in rows])


def test_the_hybrid_takes_the_partners_shape_where_the_rule_can_verify_it():
    assert hybrid_method("chain", "greedy") == "suffix-tree-chain"
    assert hybrid_method("eagle-tree", "greedy") == "suffix-eagle-tree"
    assert hybrid_method("chain", "rejection") == "suffix-tree-chain"  # suffix decoding's tree: one-hot drafts
    assert hybrid_method("eagle-tree", "rejection") is None  # a head's dynamic tree: no rejection rule
    assert hybrid_method("eagle", "sample-match") == "suffix-eagle"
    assert hybrid_method("tree", "greedy") is None and hybrid_method("prompt-lookup", "greedy") is None


def test_the_hybrids_settings_are_read_by_hybrids_alone():
    """One interleaved run shares its suffix settings between its methods: what the hybrid changes must leave suffix
    decoding alone (the best point, often) drafting as it was measured."""
    import dataclasses

    from specbench.decode.suffix_drafter import SuffixDrafter, SuffixSettings

    assert set(KNOBS) <= HYBRID_ONLY and HYBRID_ONLY <= {f.name for f in dataclasses.fields(SuffixSettings)}
    context = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    plain, changed = (SuffixDrafter(SuffixSettings(cache="drafter", **knobs), tree=True)
                      for knobs in ({}, {"other_k": 2, **KNOBS}))
    drafted = plain.propose(context, 8, None, None).tokens
    assert drafted and changed.propose(context, 8, None, None).tokens == drafted  # (factor 2 would draft 7, not 5)

def test_the_partner_is_the_best_measured_draft_model_or_head_at_one_client():
    model, head, suffix, lookup, own = (Candidate("m", "chain", draft="m"), Candidate("eagle:h", "eagle", draft="h"),
                                        Candidate("suffix", "suffix"), Candidate("prompt-lookup", "prompt-lookup"),
                                        Candidate("self-draft:2", "self-draft", self_draft_layers=2))
    every = [model, head, suffix, lookup, own]
    measured = table(("m", "chain", 2, 14.0, 1), ("m", "chain", 4, 15.0, 1), ("eagle:h", "eagle-tree", 6, 13.0, 1),
                     ("suffix", "suffix", 4, 18.0, 1), ("self-draft:2", "self-draft", 2, 20.0, 1),
                     ("m", "chain", 2, 40.0, 4))  # loaded points are not partners
    point = hybrid_point(measured, spec(), every)
    assert (point["candidate"], point["method"], point["k"], point["other_k"]) == ("m", "suffix-tree-chain", BUDGET, 4)
    assert point["partner"]["label"] == "m: chain K=4"
    heads = table(("m", "chain", 4, 12.0, 1), ("eagle:h", "eagle-tree", 6, 13.0, 1))
    assert hybrid_point(heads, spec(), every)["method"] == "suffix-eagle-tree"
    assert hybrid_point(measured, spec(), [model, head, lookup, own]) is None  # suffix decoding not a candidate
    assert hybrid_point(table(("suffix", "suffix", 4, 18.0, 1)), spec(), every) is None  # no draft measured


def test_a_tune_for_several_clients_measures_the_hybrid_alone_and_at_the_heaviest_load(tmp_path):
    """Through a worker with clients (1, 2): the hybrid runs alone (its drafts recorded, with which drafter made
    each) and at 2 clients, each replaying them, step for step what it drafted alone; the loaded row's prediction
    replays the lone run's steps against the worker, the lone row has none; both rows join the measured points the
    choice is made from, the report says how they ran, and a rerun reads them back."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from worker_helpers import ThreadWorker

    from specbench.decode.replay_drafter import load_proposals
    from specbench.tune import phases
    from specbench.tune.spec import candidate, split_prompts

    worker = ThreadWorker(batch_wait_ms="50")
    try:
        tuned = spec(endpoint=worker.endpoint, clients=(1, 2))
        result = tune(tuned, tmp_path, progress=False)
        assert result.hybrid is None  # no interleaved run: the hybrid's rows are measured points
        rows = result.measured[result.measured["other_k"].notna()]
        assert rows["method"].tolist() == ["suffix-tree-chain"] * 2 and rows["clients"].tolist() == [1, 2], rows
        alone, loaded = rows.iloc[0], rows.iloc[1]
        assert pd.isna(alone["predicted_tokens_per_s"]) and loaded["predicted_tokens_per_s"] > 0
        assert loaded["label"] == f"{alone['label']}, 2 clients" and loaded["measured_tokens_per_s"] > 0
        assert "then at 2 clients replaying them" in result.report_path.read_text()
        # the two runs, read back from the tune's folder: the loaded one replays the lone one step for step
        settings, draft, store = {"other_k": int(alone["other_k"]), **KNOBS}, candidate(DRAFT), phases.Store(tmp_path)
        _, held = split_prompts([list(p) for p in PROMPTS[:6]], tuned.calibration_share)
        key = phases.point_key(tuned, draft, "suffix-tree-chain", BUDGET, held, 1, settings)
        proposals = load_proposals(tmp_path / "measured" / f"{key}.proposals.json")
        assert proposals and {found[3] for found in proposals.values()} == {"suffix", "other"}
        lone = store.measured(key)
        both = store.measured(phases.point_key(tuned, draft, "suffix-tree-chain", BUDGET, held, 2, settings))
        assert (both["replay_misses"] == 0).all() and both["batch_size"].max() == 2
        columns = ["drafted", "accepted", "draft_source"]
        for index in range(len(held)):
            ran = both[both["prompt_index"] == index]
            first = ran[ran["client"] == ran["client"].min()]
            assert first[columns].values.tolist() == lone.loc[lone["prompt_index"] == index, columns].values.tolist()
        # a rerun reads every point back (it may measure more: what the first run's measuring left for it)
        again = tune(tuned, tmp_path, progress=False)
        before = dict(zip(result.measured["label"], result.measured["measured_tokens_per_s"]))
        after = dict(zip(again.measured["label"], again.measured["measured_tokens_per_s"]))
        same = sorted(set(before) & set(after))
        assert alone["label"] in same or loaded["label"] not in after  # (its partner may have changed)
        assert [after[label] for label in same] == pytest.approx([before[label] for label in same], rel=1e-9)
    finally:
        worker.stop()


def test_after_a_duel_the_loaded_points_and_the_hybrids_stay_in_the_choice():
    """A duel settles the best two one-client points; before, a tune for several clients then chose among the duel's
    rows alone, and a cheaper loaded point could never be chosen."""
    from specbench.tune.duel import choice_rows
    from specbench.tune.report import chosen_config

    measured = table(("m", "chain", 4, 15.0, 1), ("m", "chain", 2, 14.0, 1), ("m", "chain", 4, 12.0, 4)).assign(
        other_k=None)
    hybrid = table(("m", "suffix-tree-chain", BUDGET, 16.0, 1)).iloc[1:].assign(other_k=4)
    measured = pd.concat([measured, hybrid], ignore_index=True)
    duel = table(("m", "chain", 4, 15.5, 1), ("m", "chain", 2, 14.5, 1))
    rows = choice_rows(measured, duel)
    assert rows["label"].tolist() == [*duel["label"], "m: chain K=4 x4", "m: suffix-tree-chain K=16"]
    assert choice_rows(measured, None) is measured
    cheap = rows.assign(total_cost_usd_per_mtok=[100 / 10, 100 / 15.5, 100 / 14.5, 1.0, 100 / 16])
    every = [Candidate("m", "chain", draft="m"), Candidate("suffix", "suffix")]
    assert chosen_config(cheap, spec(cs=1.0), every)["clients"] == 4  # cost alone: the loaded point
    assert chosen_config(rows, spec(cs=0.0), every)["suffix"] == {"other_k": 4, **KNOBS}  # speed alone: the hybrid


def test_the_hybrid_runs_beside_the_best_point_and_its_own_draft_alone(monkeypatch):
    import specbench.tune.hybrid as hybrid

    ran = []

    def fake(store, runner, pair, base_label, *rest, suffix=None):
        ran.append(([row["method"] for row in pair], suffix))
        return pd.DataFrame([{"label": base_label, "method": "target-only"}] + [dict(label=row["label"],
                             method=row["method"]) for row in pair])

    monkeypatch.setattr(hybrid, "side_by_side", fake)
    every = [Candidate("m", "chain", draft="m"), Candidate("suffix", "suffix")]
    suffix_best = table(("m", "chain", 4, 15.0, 1), ("suffix", "suffix", 6, 18.0, 1))
    found = beside_hybrid(suffix_best, suffix_best, spec(), every, {}, None, None, [], 0.0, float("inf"), False, [])
    assert ran[-1] == (["suffix", "chain", "suffix-tree-chain"], {"other_k": 4, **KNOBS})
    assert found["other_k"].tolist()[-1] == 4 and found["other_k"].isna().sum() == 3
    model_best = table(("m", "chain", 4, 19.0, 1), ("suffix", "suffix", 6, 18.0, 1))
    beside_hybrid(model_best, model_best, spec(), every, {}, None, None, [], 0.0, float("inf"), False, [])
    assert ran[-1][0] == ["chain", "suffix-tree-chain"]  # the best point is its draft alone
    left_out = []
    assert beside_hybrid(model_best, model_best, spec(), every, {}, None, None, [], 0.0, 0.0, False, left_out) is None
    assert "would pass the budget" in left_out[0]

    def refused(*args, **kwargs):
        raise SpecbenchError("draft head h shares its target's embeddings")

    monkeypatch.setattr(hybrid, "side_by_side", refused)  # the tune keeps its own choice and says why
    assert beside_hybrid(model_best, model_best, spec(), every, {}, None, None, [], 0.0, float("inf"), False,
                         left_out) is None
    assert "could not run (draft head h shares" in left_out[-1]

def test_tune_runs_the_hybrid_beside_its_best_point_and_chooses_on_that_run(tmp_path):
    from specbench.api import outputs, run
    from specbench.cli import build_parser
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.tune.command import apply_config
    from specbench.tune.report import chosen_config, read_config

    result = tune(spec(), tmp_path, progress=False)
    hybrid = result.hybrid
    assert hybrid is not None and hybrid["method"].iloc[0] == "target-only"
    assert {"chain", "suffix-tree-chain"} <= set(hybrid["method"])  # beside its own draft alone, best or not
    row = hybrid[hybrid["method"] == "suffix-tree-chain"].iloc[0]
    partner = result.measured[result.measured["candidate"] == DRAFT]
    assert row["k"] == BUDGET and row["other_k"] in set(partner["k"]) and row["measured_tokens_per_s"] > 0
    chosen = hybrid.loc[hybrid["label"] == result.chosen["label"]].iloc[0]  # the choice is made on that run
    assert result.chosen["measured_tokens_per_s"] == pytest.approx(chosen["measured_tokens_per_s"], rel=1e-3)
    page = result.report_path.read_text()
    assert "ran beside the best point" in page  # and the hybrid is drawn among the measured points, beside the note
    assert page.count(str(row["label"])) >= 2
    stored = {p: p.stat().st_mtime_ns for p in (tmp_path / "measured").glob("duel-*other*.json")}
    assert len(stored) == 1
    again = tune(spec(), tmp_path, progress=False)  # resumed: read, not rerun
    assert {p: p.stat().st_mtime_ns for p in stored} == stored
    # a rerun calibrates anew and may measure points the first did not, and so run another best point beside the
    # hybrid (in a file of its own); where it runs the same points, they are read back, not run again
    ran = lambda rows: sorted(zip(rows["label"], rows["other_k"].fillna(0)))  # noqa: E731
    if ran(again.hybrid) == ran(hybrid):
        assert again.hybrid["measured_tokens_per_s"].tolist() == pytest.approx(
            hybrid["measured_tokens_per_s"].tolist(), rel=1e-9)
    else:
        assert len(list((tmp_path / "measured").glob("duel-*other*.json"))) == 2
    # the hybrid chosen (J favours it here): its budget for the draft is written and read back
    speeds = [99.0 if method == "suffix-tree-chain" else 10.0 for method in hybrid["method"]]
    favoured = hybrid.assign(measured_tokens_per_s=speeds, total_cost_usd_per_mtok=1.0)
    config = chosen_config(favoured, spec(), [Candidate(DRAFT, "chain", draft=DRAFT), Candidate("suffix", "suffix")])
    assert (config["method"], config["k"], config["draft"]) == ("suffix-tree-chain", BUDGET, DRAFT)
    assert config["suffix"] == {"other_k": int(row["other_k"]), **KNOBS}  # what the hybrid ran with
    path = tmp_path / "tune-hybrid.json"
    path.write_text(json.dumps(config))
    assert read_config(path)["suffix"] == config["suffix"]
    args = build_parser().parse_args(["run", "--config", str(path)])
    apply_config(args)
    assert args.method[-1] == "suffix-tree-chain" and args.suffix[0] == f"other_k={int(row['other_k'])}"
    assert len(args.suffix) == 1 + len(KNOBS)
    args = build_parser().parse_args(["run", "--config", str(path), "--suffix", "other_k=1"])
    apply_config(args)
    assert args.suffix == ["other_k=1"]  # the command line's own setting wins
    # what the choice runs is lossless: greedy, the hybrid's output is target-only's
    records = run("tiny-random:seed=0", [list(p) for p in PROMPTS[:3]], method=["target-only", "suffix-tree-chain:16"],
                  draft=DRAFT, max_new_tokens=12, suffix=SuffixSettings(**config["suffix"]), progress=False)
    ids = outputs(records)
    assert all(ids[("suffix-tree-chain", i)] == ids[("target-only", i)] for i in range(3))


def test_a_configurations_suffix_settings_are_checked_and_served(tmp_path):
    from specbench.cli import build_parser
    from specbench.serve.command import settings_from
    from specbench.tune.report import read_config

    base = {"target": "tiny-random:seed=0", "method": "suffix-tree-chain", "k": 16, "draft": DRAFT}
    for suffix, named in (({"other_k": 0}, "other_k"), ({"nope": 1}, "nope"), ({"other_k": "x"}, "other_k")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**base, "suffix": suffix}))
        with pytest.raises(SpecbenchError, match=f"suffix .*{named}"):
            read_config(path)
    path = tmp_path / "good.json"
    path.write_text(json.dumps({**base, "suffix": {"other_k": 3}, "dtype": "bfloat16", "max_new_tokens": 40}))
    settings = settings_from(build_parser().parse_args(["serve", "--config", str(path)]))
    assert settings.methods[0] == "suffix-tree-chain" and settings.suffix.other_k == 3
    assert settings.tuned == ("suffix-tree-chain", 40)  # requests far from 40 tokens are told (test_serve)
    assert "up to 40 tokens and now serves 200-token" in settings.tune_note("suffix-tree-chain", 200)
    assert settings.tune_note("suffix-tree-chain", 60) is None and settings.tune_note("target-only", 200) is None
    assert settings.dtype == "bfloat16"  # the dtype the choice was measured at
    settings = settings_from(build_parser().parse_args(["serve", "--config", str(path), "--suffix", "other_k=2",
                                                        "--dtype", "float32"]))
    assert settings.suffix.other_k == 2 and settings.dtype == "float32"  # the command line's own settings win
    assert settings_from(build_parser().parse_args(["serve", "--target", "smollm2-135m"])).dtype == "float32"
