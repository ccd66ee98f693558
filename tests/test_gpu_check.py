"""The GPU issue's prepared script, rehearsed on a CPU: every part runs in its small CPU form and the report says
the CUDA measurements were skipped. Why here: GPU time comes in short leases, so the script must not first
fail there."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["cuda-tests", "step", "worker-load", "worker-load-target-only", "profiles", "serve", "heads",
         "step-compiled", "cuda-tests-compiled"]


def test_the_gpu_check_rehearses_every_part_on_a_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["cuda"] is False and [part["name"] for part in report["parts"]] == PARTS
    assert all(part["status"] == "ok" for part in report["parts"]), [(p["name"], p["status"]) for p in report["parts"]]
    text = (out / "gpu_check.md").read_text()
    assert text.count("CPU rehearsal: CUDA measurement skipped") == len(PARTS)
    assert "skipped" in " ".join(report["parts"][0]["tail"])  # test_cuda.py skips itself without CUDA
    step = report["parts"][1]["report"]
    assert step["steps"] and step["steps"][0]["lean_ms"] > 0 and step["kernels"] == []  # no device kernels here
    load = report["parts"][2]["report"]
    assert [row["clients"] for row in load["rows"]] == [1, 2] and all(row["lossless"] for row in load["rows"])
    assert all(row["measured_tok_s"] > 0 and row["predicted_tok_s"] > 0 for row in load["rows"])
    with tarfile.open(out / "profiles.tar.gz") as archive:
        assert sum(name.endswith(".json") and "profile-tiny" in name for name in archive.getnames()) == 4
    alone = report["parts"][3]["report"]  # target-only under the same load
    assert [row["clients"] for row in alone["rows"]] == [1, 2] and all(row["lossless"] for row in alone["rows"])
    assert alone["accepted_per_step"] == 0
    assert report["parts"][5]["report"]["identical"] == {"cpu": 9}
    heads = report["parts"][6]["report"]
    assert heads["identical"] == heads["agree_with_target_only"] == {"cpu": 48}  # 8 methods, 6 prompts
    assert heads["accepted_per_step"]["cpu"]["eagle"] > 0.5  # the trained head is accepted: a real smoke
    assert heads["accepted_per_step"]["cpu"]["suffix-tree-chain-confident@draft"] > 0.3  # the own draft drafts
    compiled = report["parts"][7]["report"]["steps"]  # the lean step alone (no Hugging Face step to compile)
    assert [row["tokens"] for row in compiled] == [1] and compiled[0]["hf_step_ms"] is None
