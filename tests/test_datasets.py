"""Prompt sets: registry-backed loaders, JSONL formats, deterministic sampling, bad input."""
import json

import pytest

from specbench.cli import main
from specbench.datasets import DatasetError, load_prompts, parse_jsonl, sample_rows
from specbench.types import SpecbenchError


def test_project_prompt_list_loads_with_sets():
    rows = load_prompts("bench")
    assert {row["set"] for row in rows} == {"code", "chat"}
    assert all(row["prompt"] == row["turns"][0] for row in rows)


@pytest.mark.parametrize("name,count,first_id", [("mt-bench", 80, "81"), ("humaneval", 164, "HumanEval/0")])
def test_registry_datasets_have_their_published_sizes(name, count, first_id):
    rows = load_prompts(name)
    assert len(rows) == count
    assert rows[0]["id"] == first_id
    if name == "mt-bench":
        assert all(len(row["turns"]) == 2 for row in rows), "MT-bench questions have two turns"


def test_sampling_is_deterministic_and_in_file_order():
    rows = [{"id": str(i)} for i in range(100)]
    first, again, other = sample_rows(rows, 10, seed=1), sample_rows(rows, 10, seed=1), sample_rows(rows, 10, seed=2)
    assert first == again and first != other
    assert [int(r["id"]) for r in first] == sorted(int(r["id"]) for r in first)
    with pytest.raises(DatasetError, match=">= 1"):
        sample_rows(rows, 0)


def test_spec_bench_and_user_jsonl_formats(tmp_path):
    path = tmp_path / "question.jsonl"
    lines = [{"question_id": 7, "category": "math_reasoning", "turns": ["What is 2+2?", "And 3+3?"]},
             {"prompt": "Say hi."}, {"text": "Plain text row"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    rows = load_prompts(str(path))
    assert [r["prompt"] for r in rows] == ["What is 2+2?", "Say hi.", "Plain text row"]
    assert rows[0]["set"] == "math_reasoning" and rows[0]["id"] == "7" and rows[1]["set"] == "question"


def test_malformed_lines_are_reported_by_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{broken\n[1, 2]\n{"turns": []}\n{"prompt": ""}\n')
    with pytest.raises(DatasetError) as error:
        parse_jsonl(path)
    message = str(error.value)
    for number in (2, 3, 4, 5):
        assert f"line {number}:" in message
    assert "line 1:" not in message


def test_unknown_dataset_names_the_known_ones(capsys):
    with pytest.raises(SpecbenchError, match="mt-bench"):
        load_prompts("no-such-dataset")
    assert main(["datasets", "show", "no-such-dataset"]) == 2
    assert "unknown dataset" in capsys.readouterr().err


def test_sharegpt_conversations_become_human_turns(tmp_path):
    from specbench.datasets.loaders import sharegpt_rows

    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps([
        {"id": "a1", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello"},
                                       {"from": "human", "value": "Tell me a joke"},
                                       {"from": "human", "value": "third turn, dropped"}]},
        {"id": "b2", "conversations": [{"from": "gpt", "value": "only the model speaks"}]},
        {"id": "c3", "conversations": [{"from": "human", "value": "   "}, {"from": "human", "value": "Real question"}]},
        "not a conversation"]))
    compact = tmp_path / "cache" / "first_turns.jsonl"
    rows = sharegpt_rows(source, compact)
    assert [(r["id"], r["turns"]) for r in rows] == [("a1", ["Hi there", "Tell me a joke"]), ("c3", ["Real question"])]
    assert all(r["set"] == "sharegpt" for r in rows)
    source.write_text("{corrupt")  # the compact cache is used from now on
    assert sharegpt_rows(source, compact) == rows
    with pytest.raises(DatasetError, match="fetch again"):
        sharegpt_rows(source, tmp_path / "fresh.jsonl")
    source.write_text('[{"id": "x", "conversations": []}]')
    with pytest.raises(DatasetError, match="no prompts"):
        sharegpt_rows(source, tmp_path / "empty.jsonl")


def test_sharegpt_cut_off_mid_conversation_keeps_the_complete_ones(tmp_path):
    """The registry's file ends mid-conversation; everything before the cut is kept."""
    from specbench.datasets.loaders import sharegpt_rows

    whole = json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"}]}
                        for i in range(5)], indent=2)
    source = tmp_path / "cut.json"
    source.write_text(whole[: whole.index('"question 4"') + 5])
    with pytest.warns(UserWarning, match="kept the 4 complete conversations"):
        rows = sharegpt_rows(source, tmp_path / "cut.jsonl")
    assert [r["prompt"] for r in rows] == [f"question {i}" for i in range(4)]
