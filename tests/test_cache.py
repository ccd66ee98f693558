"""profiles/ and reference/ files: round trips, clear errors for corrupt or old files, concurrent writers."""
import json
import os
import multiprocessing

import pytest

from specbench.cache.store import CacheError, read_record, write_record
from specbench.plan.library import (load_concurrency, load_profiles, load_references, save_concurrency, save_profile,
                                    save_reference)
from specbench.plan.predict import AcceptanceReference, LatencyProfile


def test_profile_and_reference_round_trip(tmp_path):
    profile = LatencyProfile("m", "cpu", "float32", "none", ((1, 128, 0.01), (4, 128, 0.02)))
    path = save_profile(profile, folder=tmp_path)
    assert load_profiles(tmp_path) == [profile]
    assert save_profile(profile, folder=tmp_path) == path  # same metadata, same file name
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # shared data: not mkstemp's owner-only mode
    reference = AcceptanceReference("d", "t", "mt-bench", chain_accepts=(1, 2, 8), tree_accepts={16: (3, 4)},
                                    tree_depth={16: 4.5}, tree_width={16: 8})
    save_reference(reference, folder=tmp_path)
    assert load_references(tmp_path) == [reference]
    index = json.loads((tmp_path / "index.json").read_text())
    assert {entry["kind"] for entry in index.values()} == {"profile", "reference"}


def test_measured_concurrency_round_trip_keeps_runs_apart(tmp_path):
    """Measured speedups under load (benchmarks/concurrency.py --save-measured) come back per pair, each
    series naming its run's dtype and load, so two runs of one pair never merge into one line."""
    import pandas as pd

    measured = pd.DataFrame({"clients": [1, 8], "series": ["chain K=4"] * 2, "speedup": [1.4, 0.9],
                             "tokens_per_s": [5.0, 2.0], "target_only_tokens_per_s": [3.6, 2.2]})
    for load in ("steady 40 s, 96 tokens", "1 prompt(s) per client, 24 tokens"):
        save_concurrency(measured, {"target": "t", "draft": "d", "device": "cpu", "dtype": "float32", "load": load},
                         folder=tmp_path)
    save_concurrency(measured.assign(speedup=2.0), {"target": "t", "draft": "prompt-lookup", "device": "cpu",
                                                    "dtype": "float32", "load": "steady"}, folder=tmp_path)
    got = load_concurrency(tmp_path, target="t", draft="d")
    assert len(got) == 4 and sorted(got["speedup"]) == [0.9, 0.9, 1.4, 1.4]
    assert set(got["series"]) == {"chain K=4 (cpu, float32, steady 40 s, 96 tokens)",
                                  "chain K=4 (cpu, float32, 1 prompt(s) per client, 24 tokens)"}
    assert load_concurrency(tmp_path, target="t", draft="d", device="NVIDIA-H100-80GB-HBM3").empty  # notebook 03's view
    assert len(load_concurrency(tmp_path)) == 6 and load_concurrency(tmp_path, target="other").empty
    path = next(tmp_path.glob("concurrency-*.json"))
    path.write_text("{")
    with pytest.raises(CacheError, match=rf"{path.name}.*corrupt.*benchmarks/concurrency.py --save-measured"):
        load_concurrency(tmp_path)


def test_corrupt_file_names_itself_and_the_rebuild_command(tmp_path):
    path = write_record(tmp_path, "profile", {"model": "m"}, {"rows": []})
    path.write_text('{"schema": 1, "kind": "prof')
    with pytest.raises(CacheError, match=rf"{path.name}.*corrupt.*specbench profile"):
        read_record(path)


def test_old_schema_is_refused(tmp_path):
    path = write_record(tmp_path, "reference", {"draft": "d"}, {})
    document = json.loads(path.read_text())
    document["schema"] = 0
    path.write_text(json.dumps(document))
    with pytest.raises(CacheError, match="schema 0.*rebuild"):
        read_record(path)


def _writer(folder, index):
    for round_ in range(20):
        write_record(folder, "profile", {"model": "same"}, {"rows": [[index, round_, 0.1]] * 200})
        write_record(folder, "profile", {"model": f"m{index}"}, {"rows": [[round_, 1, 0.1]]})


def test_concurrent_writers_never_corrupt_a_file(tmp_path):
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_writer, args=(tmp_path, i)) for i in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    files = sorted(tmp_path.glob("profile-*.json"))
    assert len(files) == 5
    for path in files:
        read_record(path)  # every file parses completely
    assert len(json.loads((tmp_path / "index.json").read_text())) == 5
    assert not list(tmp_path.glob(".*.tmp"))  # no writer's temporary file left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """`specbench.files.replacing`: what every cache, checkpoint and sweep cell is written through."""
    from specbench.files import replacing, write_text

    path = tmp_path / "deep" / "cell.json"
    write_text(path, "old")
    with pytest.raises(RuntimeError, match="killed"):
        with replacing(path) as temporary:
            temporary.write_text("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in path.parent.iterdir()) == ["cell.json"]
    with replacing(path) as first, replacing(path) as second:  # two writers at once pick different names
        assert first != second
        first.write_text("first")
        second.write_text("second")
    assert path.read_text() == "first"  # the last to finish wins, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["cell.json"]
