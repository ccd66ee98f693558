"""Generated text coloured by where each token came from: accepted draft tokens vs target-produced."""
from __future__ import annotations

import html

import pandas as pd

DRAFT_COLOR, TARGET_COLOR = "#c8f0c8", "#f6d7a7"


def token_sources(records: pd.DataFrame, method: str, prompt_index: int = 0) -> list[tuple[int, str]]:
    """(token id, "draft" | "target") for each emitted token; per step the first `accepted` emitted
    tokens were drafted and accepted, the rest (the bonus) came from the target."""
    steps = records[(records["method"] == method) & (records["prompt_index"] == prompt_index)].sort_values("step")
    out = []
    for _, step in steps.iterrows():
        for position, token in enumerate(step["emitted_tokens"]):
            out.append((int(token), "draft" if position < step["accepted"] else "target"))
    return out


def colored_text_html(records: pd.DataFrame, tokenizer, method: str, prompt_index: int = 0) -> str:
    """HTML spans: green = drafted and accepted, orange = produced by the target."""
    spans = []
    for token, source in token_sources(records, method, prompt_index):
        text = html.escape(tokenizer.decode([token])).replace("\n", "&#8629;<br>")
        color = DRAFT_COLOR if source == "draft" else TARGET_COLOR
        spans.append(f"<span style='background:{color}' title='{source}'>{text}</span>")
    legend = (f"<div style='font-size:90%'><b>{html.escape(method)}</b>: <span style='background:{DRAFT_COLOR}'>"
              f"drafted and accepted</span> <span style='background:{TARGET_COLOR}'>target-produced</span></div>")
    return legend + "<div style='font-family:monospace;white-space:pre-wrap'>" + "".join(spans) + "</div>"
