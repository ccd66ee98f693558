"""Prompt sets: the project's own lists, registry-backed benchmarks (MT-bench, HumanEval, ShareGPT),
Spec-Bench's question.jsonl and any user JSONL, all as lists of prompt rows."""
from specbench.datasets.loaders import DatasetError, load_prompts, parse_jsonl, sample_rows
from specbench.datasets.sources import DATASETS, fetch_dataset

__all__ = ["DATASETS", "DatasetError", "fetch_dataset", "load_prompts", "parse_jsonl", "sample_rows"]
