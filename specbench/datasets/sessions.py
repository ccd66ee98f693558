"""Multi-turn sessions as a request stream: each turn's prompt holds the model's own earlier answers.

A session's second request repeats what the model said in its first (a chat's history, a file resent with
a change, a tool call made again), which is the repetition suffix decoding and prompt lookup draft from.
The answers come from the target's own greedy decoding, so the stream is what any lossless method would
see; requests come turn-major (every session's first turn, then every second turn...), as sessions that
run at once would reach a server.
"""
from __future__ import annotations

from typing import Optional, Sequence

from specbench.types import SpecbenchError


def script_sessions(target, rows: Sequence[dict], max_new_tokens: int = 64, max_turns: Optional[int] = None,
                    progress: bool = True) -> list[dict]:
    """Requests {session, set, turn, ids, output} for `rows` (dataset rows with `turns`), each prompt the chat
    so far through the target's chat template. `target`: anything `run` takes, with a tokenizer."""
    from specbench.api import as_target, outputs, run

    target, _ = as_target(target)
    tokenizer = target.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SpecbenchError("scripting sessions needs the target's tokenizer and its chat template")
    if not rows:
        raise SpecbenchError("no sessions to script")
    histories = [[] for _ in rows]
    requests = []
    turns = max(len(row["turns"]) for row in rows) if max_turns is None else max_turns
    for turn in range(turns):
        live = [i for i, row in enumerate(rows) if turn < len(row["turns"])]
        prompts = []
        for i in live:
            histories[i].append({"role": "user", "content": rows[i]["turns"][turn]})
            text = tokenizer.apply_chat_template(histories[i], tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        produced = outputs(run(target, prompts, method="target-only", max_new_tokens=max_new_tokens, warmup=False,
                               progress=f"script turn {turn + 1}/{turns}" if progress else False))
        for slot, i in enumerate(live):
            output = produced[("target-only", slot)]
            histories[i].append({"role": "assistant", "content": tokenizer.decode(output, skip_special_tokens=True)})
            requests.append({"session": rows[i]["id"], "set": rows[i]["set"], "turn": turn, "ids": prompts[slot],
                             "output": output})
    return requests
