"""Parse prompt files into rows {id, set, prompt, turns} and sample N of them deterministically."""
from __future__ import annotations

import gzip
import json
import random
import warnings
from pathlib import Path
from typing import Optional

from specbench.datasets.sources import DATASETS, LOCAL, dataset_source, fetch_dataset
from specbench.models.catalog import cache_root
from specbench.types import SpecbenchError


class DatasetError(SpecbenchError):
    pass


def load_prompts(name_or_path: str, limit: Optional[int] = None, seed: int = 0) -> list[dict]:
    """Rows of a named dataset (see `DATASETS`, plus "bench") or of a JSONL file path.

    JSONL lines may be Spec-Bench / MT-bench questions ({"turns": [...]}), HumanEval problems
    ({"prompt": ...}), or any {"prompt": ...} / {"text": ...} object. With `limit`, a seeded sample
    of that many rows in file order, the same on every machine.
    """
    if name_or_path in LOCAL:
        rows = parse_jsonl(LOCAL[name_or_path], default_set=name_or_path)
    elif name_or_path in DATASETS:
        source = dataset_source(name_or_path)
        path = fetch_dataset(name_or_path)
        rows = (sharegpt_rows(path, cache_root() / "datasets" / "sharegpt" / "first_turns.jsonl")
                if source.format == "sharegpt" else parse_jsonl(path, default_set=name_or_path))
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            dataset_source(name_or_path)  # raises: unknown name, with the list of known ones
        rows = parse_jsonl(path, default_set=path.stem)
    return sample_rows(rows, limit, seed)


def sample_rows(rows: list[dict], limit: Optional[int], seed: int = 0) -> list[dict]:
    if limit is None or limit >= len(rows):
        return list(rows)
    if limit < 1:
        raise DatasetError(f"number of prompts must be >= 1, got {limit}")
    chosen = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[i] for i in chosen]


def parse_jsonl(path: Path | str, default_set: str = "prompts") -> list[dict]:
    """Every line a JSON object with turns, prompt or text; bad lines are reported by number, all at once."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows, problems = [], []
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                problems.append(f"line {number}: not JSON ({error.msg})")
                continue
            row = _row(item, number, default_set)
            if isinstance(row, str):
                problems.append(f"line {number}: {row}")
            else:
                rows.append(row)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise DatasetError(f"{path}: {len(problems)} malformed line(s): {shown}")
    if not rows:
        raise DatasetError(f"{path}: no prompts found")
    return rows


def _row(item, number: int, default_set: str) -> dict | str:
    if not isinstance(item, dict):
        return f"expected a JSON object, got {type(item).__name__}"
    turns = item.get("turns")
    if turns is None:
        text = item.get("prompt", item.get("text"))
        if not isinstance(text, str) or not text.strip():
            return "needs a non-empty 'prompt' (or 'text') string, or a 'turns' list"
        turns = [text]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        return "'turns' must be a non-empty list of non-empty strings"
    identity = item.get("question_id", item.get("task_id", item.get("id", number)))
    return {"id": str(identity), "set": str(item.get("category", item.get("set", default_set))),
            "prompt": turns[0], "turns": list(turns)}


def sharegpt_rows(path: Path, compact: Path) -> list[dict]:
    """The human turns (first two) of each ShareGPT conversation; the big JSON is parsed once and kept
    as compact JSONL at `compact`. Conversations without a human turn are skipped.

    The registry package ships the JSON cut off mid-conversation (125 MB of a larger file), so the
    array is read item by item and every complete conversation before the cut is kept, with a warning.
    """
    if not compact.exists():
        conversations = _json_array_items(path)
        compact.parent.mkdir(parents=True, exist_ok=True)
        partial = compact.with_suffix(".partial")
        with open(partial, "w", encoding="utf-8") as out:
            for index, conversation in enumerate(conversations):
                messages = conversation.get("conversations", []) if isinstance(conversation, dict) else []
                turns = [m.get("value", "") for m in messages if isinstance(m, dict) and m.get("from") == "human"]
                turns = [t for t in turns if isinstance(t, str) and t.strip()]
                if turns:
                    identity = conversation.get("id", index)
                    out.write(json.dumps({"id": identity, "set": "sharegpt", "turns": turns[:2]}) + "\n")
        partial.replace(compact)
    return parse_jsonl(compact, default_set="sharegpt")


def load_conversations(name_or_path: str, limit: Optional[int] = None, seed: int = 0) -> list[list[dict]]:
    """Whole exchanges, [{"role": "user" | "assistant", "content": ...}, ...] each: ShareGPT's human and
    gpt turns in order (what a draft head trains on teacher-forced, as EAGLE did), or a JSONL path whose
    lines hold {"messages": [...]}. Sampled like `load_prompts` (same seed, same conversations)."""
    if name_or_path == "sharegpt":
        compact = cache_root() / "datasets" / "sharegpt" / "conversations.jsonl"
        if not compact.exists():
            items = _json_array_items(fetch_dataset("sharegpt"))
            partial = compact.with_suffix(".partial")
            with open(partial, "w", encoding="utf-8") as out:
                for item in items:
                    messages = [{"role": {"human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]}
                                for m in (item.get("conversations") or []) if isinstance(m, dict)
                                and m.get("from") in ("human", "gpt") and isinstance(m.get("value"), str)]
                    if len(messages) >= 2 and messages[0]["role"] == "user" and messages[0]["content"].strip():
                        out.write(json.dumps({"messages": messages}) + "\n")
            partial.replace(compact)
        path = compact
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise DatasetError(f"conversations come from 'sharegpt' or a JSONL file of {{\"messages\": [...]}} "
                               f"lines; {name_or_path!r} is neither")
    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    messages = json.loads(line)["messages"]
                except (ValueError, KeyError, TypeError):
                    raise DatasetError(f"{path}:{number}: not a {{\"messages\": [...]}} line") from None
                rows.append(messages)
    return sample_rows(rows, limit, seed)


def _json_array_items(path: Path) -> list:
    """Items of a top-level JSON array, keeping the complete ones when the file is cut short."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read ({error}); delete it and fetch again") from None
    decoder = json.JSONDecoder()
    position = len(text) - len(text.lstrip())
    if not text.startswith("[", position):
        raise DatasetError(f"{path}: expected a JSON list of conversations; delete it and fetch again "
                           f"with `specbench datasets fetch sharegpt`")
    items, position = [], position + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return items
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            if not items:
                raise DatasetError(f"{path}: no readable conversation ({error.msg} at char {error.pos}); "
                                   f"delete it and fetch again with `specbench datasets fetch sharegpt`") from None
            warnings.warn(f"{path} is cut off at char {error.pos} of {len(text)}: "
                          f"kept the {len(items)} complete conversations before it")
            return items
        items.append(item)
