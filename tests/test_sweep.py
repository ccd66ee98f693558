"""Sweeps: typed grid and hashes, per-cell results that make reruns resume, the local and Ray executors."""
import json
import os
import sys

import pytest

from specbench.sweep import SweepCell, expand, load_grid, sweep
from specbench.sweep.drill import kill_running_cell_later
from specbench.types import SpecbenchError

TINY = dict(target="tiny-random:seed=0", draft="tiny-random:seed=1,noise=0.005,noise_from=0",
            prompts=[[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 9, 10, 11]])
COMPARED = ["cell", "method", "prompt_index", "step", "emitted_tokens", "accepted", "drafted", "k"]


def tiny_grid(max_new_tokens=(8, 12)):
    """8 cells: budgets x methods-run-together x lengths, on the tiny target/draft pair."""
    return expand({"k": [2, 3], "methods": [["target-only", "chain"], ["tree"]],
                   "max_new_tokens": list(max_new_tokens)}, TINY)


def comparable(records):
    frame = records[COMPARED].sort_values(COMPARED[:4]).reset_index(drop=True)
    return frame.assign(emitted_tokens=frame["emitted_tokens"].map(list))


def test_cell_hash_names_everything_that_defines_a_cell():
    cell = SweepCell(**TINY, k=3)
    assert cell.key == SweepCell(**TINY, k=3).key and len(cell.key) == 16
    changed = [SweepCell(**TINY, k=4), SweepCell(**{**TINY, "prompts": [[1, 2, 3]]}, k=3),
               SweepCell(**TINY, k=3, target_quantization="int8-dynamic"), SweepCell(**TINY, k=3, temperature=0.5)]
    assert len({cell.key, *(c.key for c in changed)}) == 5
    assert SweepCell(methods="chain").methods == ("chain",)
    assert SweepCell(**TINY, k=3, device="cpu").key == cell.key  # a default value does not enter the hash
    assert SweepCell(temperature=1).key == SweepCell(temperature=1.0).key
    assert SweepCell(rule="greedy").key == SweepCell().key


def test_a_sampled_cell_samples():
    """A cell at a temperature verifies by rejection unless it names a rule, and never by argmax (which would
    give greedy text, silently): refused when it is built, not when it runs."""
    assert SweepCell(temperature=0.5).rule == "rejection" and SweepCell().rule == "greedy"
    assert SweepCell(temperature=0.5, methods=("chain", "tree")).rule == "sample-match"  # a dynamic tree
    assert SweepCell(temperature=0.5, rule="sample-match").rule == "sample-match"
    with pytest.raises(SpecbenchError, match="rule 'greedy' verifies by the target's argmax"):
        SweepCell(temperature=0.5, rule="greedy")


def test_grids_from_json_and_csv(tmp_path):
    grid = {"axes": {"k": [2, 4], "methods": [["target-only", "chain"], "prompt-lookup"]}, "fixed": {"dataset": "bench"}}
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    cells = load_grid(tmp_path / "grid.json")
    assert len(cells) == 4 and {c.methods for c in cells} == {("target-only", "chain"), ("prompt-lookup",)}
    (tmp_path / "grid.csv").write_text('target,k,methods,temperature\nsmollm2-135m,2,"[""chain""]",0.5\n'
                                       'smollm2-135m,4,"[""target-only"",""chain""]",0\n')
    rows = load_grid(tmp_path / "grid.csv")
    assert [(c.k, c.methods, c.temperature) for c in rows] == [(2, ("chain",), 0.5), (4, ("target-only", "chain"), 0.0)]
    (tmp_path / "bad.json").write_text(json.dumps({"axes": {"budget": [2]}}))
    with pytest.raises(SpecbenchError, match="unknown cell field.*budget"):
        load_grid(tmp_path / "bad.json")
    with pytest.raises(SpecbenchError, match="unknown cell kind"):
        SweepCell(kind="train")


def test_local_sweep_stores_per_cell_resumes_and_records_failures(tmp_path):
    cells = tiny_grid()
    broken = SweepCell(**{**TINY, "target": "tiny-random:seed=0,vocab=notanumber"})
    first = sweep(cells + [broken], tmp_path, progress=False)
    assert (first.ran, first.skipped, first.failed) == (9, 0, 1)
    failed = first.status[first.status["state"] == "failed"]
    assert list(failed["cell"]) == [broken.key] and "notanumber" in failed["error"].iloc[0]
    assert set(first.records["cell"]) == {c.key for c in cells}
    # chain and target-only ran side by side in one cell and agree (greedy fp32 is lossless)
    together = first.records[first.records["cell"] == cells[0].key]
    by_method = {m: [t for ts in g.sort_values(["prompt_index", "step"])["emitted_tokens"] for t in ts]
                 for m, g in together.groupby("method")}
    assert by_method["chain"] == by_method["target-only"]

    again = sweep(cells, tmp_path, progress=False)
    assert (again.ran, again.skipped) == (0, 8)
    assert comparable(again.records).equals(comparable(first.records))
    (tmp_path / "cells" / f"{cells[3].key}.parquet").unlink()  # a cell whose records were lost runs again
    partial = sweep(cells, tmp_path, progress=False)
    assert (partial.ran, partial.skipped) == (1, 7)
    assert sweep([broken], tmp_path, retry_failed=False, progress=False).ran == 0
    (tmp_path / "cells" / f"{cells[5].key}.json").write_text("{not json")  # a corrupt status file is named
    with pytest.raises(SpecbenchError, match=f"{cells[5].key}.json is unreadable.*delete it"):
        sweep(cells, tmp_path, progress=False)


def test_a_summary_names_each_cells_machine_and_warns_when_they_differ(tmp_path):
    """A sweep resumed on another box (the same host name, "vm", on VMs of different CPUs) or spread over Ray nodes:
    its summary compared cells' tokens/s across machines unsaid. Each row now names its cell's machine, and
    cells on several machines are said."""
    import warnings

    from specbench.hardware import machine_label
    from specbench.sweep import summarize_sweep

    cells = tiny_grid(max_new_tokens=(8,))[:2]
    report = sweep(cells, tmp_path, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = summarize_sweep(report.records, cells)
    assert set(table["machine"]) == {machine_label()} and not [w for w in caught if "machines" in str(w.message)]
    moved = report.records.assign(machine=report.records["machine"].where(report.records["cell"] == cells[0].key,
                                                                          "cpu-2t-Other-CPU"))
    with pytest.warns(UserWarning, match=r"ran on 2 machines \(.*cpu-2t-Other-CPU: 1 cells.*\): tokens_per_s compares"):
        table = summarize_sweep(moved, cells)
    assert table.set_index("cell")["machine"].groupby(level=0).first()[cells[1].key] == "cpu-2t-Other-CPU"
    summarize_sweep(report.records.drop(columns="machine"), cells)  # records from before machines were kept


def test_a_suffix_cell_measures_the_same_whichever_cells_ran_before_it_in_the_process(tmp_path):
    """Suffix decoding keeps outputs: a cell must not draft its prompts from an earlier cell's outputs of them,
    or its figure depends on the order the cells ran in (a rerun resuming it alone measured another)."""
    cells = expand({"k": [6, 8]}, {**TINY, "methods": ["suffix"], "max_new_tokens": 24})
    after = sweep(cells, tmp_path / "both", progress=False).records  # K=6 first, then K=8 in the same process
    alone = sweep(cells[1:], tmp_path / "alone", progress=False).records
    assert "cache_held_prompt" in after and not after["cache_held_prompt"].any()
    got = after[after["cell"] == cells[1].key]
    assert comparable(got).equals(comparable(alone))


def test_ray_executor_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if it were not installed
    with pytest.raises(SpecbenchError, match=r"pip install .*\[ray\]"):
        sweep(tiny_grid()[:1], tmp_path, executor="ray", progress=False)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module. Its tests are `serial`: Ray gives a starting node a fixed 30 s to
    register, and under `make test`'s parallel processes it took 23-29 s (and timed out with four)."""
    if os.environ.get("CI"):
        import ray  # CI installs the ray extra (make test): a missing Ray fails here instead of skipping
    else:
        ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.serial
def test_ray_gives_the_same_records_as_local(tmp_path, ray_cluster):
    cells = tiny_grid()
    local = sweep(cells, tmp_path / "local", progress=False)
    on_ray = sweep(cells, tmp_path / "ray", executor="ray", progress=False)
    assert (on_ray.ran, on_ray.failed) == (8, 0)
    assert comparable(on_ray.records).equals(comparable(local.records))
    assert on_ray.status["host"].notna().all()
    # models load once per Ray worker process and are reused by its later cells
    assert on_ray.status["models_loaded"].sum() <= 2 * 2


@pytest.mark.serial
def test_a_killed_ray_worker_loses_no_cell(tmp_path, ray_cluster):
    """kill -9 a Ray worker while it runs a cell: Ray retries that cell, every cell lands exactly once,
    and a rerun of the finished sweep does no work."""
    cells = tiny_grid(max_new_tokens=(40, 48))
    killed = kill_running_cell_later(tmp_path, after_landed=1, timeout_s=120)
    report = sweep(cells, tmp_path, executor="ray", progress=False)
    assert killed, "no running cell was found to kill"
    assert (report.ran, report.failed) == (8, 0) and (report.status["state"] == "done").all()
    per_cell = report.records.groupby(["cell", "method", "prompt_index", "step"]).size()
    assert (per_cell == 1).all() and set(report.records["cell"]) == {c.key for c in cells}
    assert sweep(cells, tmp_path, executor="ray", progress=False).ran == 0


def test_cli_runs_a_grid_with_profile_and_reference_cells(tmp_path, capsys):
    """One grid file characterises a box: a run cell, a profile cell and a reference cell, whose profile
    and reference are saved where `specbench pareto` can read them; a rerun skips all three."""
    from specbench.cli import main
    from specbench.plan.library import load_profiles, load_references

    grid = {"grids": [
        {"fixed": {**TINY, "methods": ["chain"], "k": 3, "max_new_tokens": 8}},
        {"fixed": {"kind": "profile", "target": TINY["target"], "profile_tokens": [1, 4], "profile_contexts": [16],
                   "profile_repeats": 2}},
        {"fixed": {**TINY, "kind": "reference", "k": 4, "tree_budgets": [4], "max_new_tokens": 12}}]}
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    assert main(["sweep", str(tmp_path / "grid.json"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "3 cells: ran 3 (0 failed), skipped 0" in printed and "chain" in printed
    [profile] = load_profiles(tmp_path / "out" / "profiles")
    assert profile.model == TINY["target"] and {row[0] for row in profile.rows} == {1, 4}
    [reference] = load_references(tmp_path / "out" / "reference")
    assert reference.max_chain == 4 and reference.chain_accepts and 4 in reference.tree_accepts
    assert main(["sweep", str(tmp_path / "grid.json"), "--out", str(tmp_path / "out")]) == 0
    assert "ran 0 (0 failed), skipped 3" in capsys.readouterr().out


def test_a_cell_placed_on_a_worker_gives_the_records_of_a_local_cell(tmp_path):
    """place = a worker's endpoint: the cell's target is that worker (the draft stays where the cell runs)."""
    from worker_helpers import DRAFT, TARGET, process_worker

    fixed = dict(target=TARGET, draft=DRAFT, prompts=TINY["prompts"], methods=["target-only", "chain"], k=3,
                 max_new_tokens=10)
    with process_worker() as worker:
        remote_cell = SweepCell(**fixed, place=worker.endpoint)
        report = sweep([SweepCell(**fixed), remote_cell], tmp_path, progress=False)
    assert report.failed == 0
    local, remote = (report.records[report.records["cell"] == key] for key in (report.status["cell"]))
    assert comparable(local.assign(cell="")).equals(comparable(remote.assign(cell="")))
    assert (remote["place"] == worker.endpoint).all() and (remote["bytes_up"] > 0).all()


@pytest.mark.parametrize("status,records,words", [
    ({"state": "done", "cell": {}}, b"PAR1garbage", "abc.parquet are unreadable.*delete it and abc.json"),
    (None, b"", "abc.json holds no status"),
], ids=["damaged-records", "null-status"])
def test_a_damaged_cell_in_the_results_folder_is_named(tmp_path, status, records, words):
    """An outside tester's damage to a finished cell: before, pyarrow's ArrowInvalid ("Parquet magic bytes
    not found") and an AttributeError (a `null` status) came out of `records()` with no remedy."""
    from specbench.sweep.store import ResultStore

    store = ResultStore(tmp_path)
    store.cells_folder.mkdir(parents=True, exist_ok=True)
    (store.cells_folder / "abc.json").write_text(json.dumps(status))
    (store.cells_folder / "abc.parquet").write_bytes(records)
    with pytest.raises(SpecbenchError, match=words):
        store.records()
