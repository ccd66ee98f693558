"""A self-contained HTML Pareto report (plotly.js inlined, so it opens offline and in CI browsers)."""
from __future__ import annotations

import html
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from specbench.plan.costs import PRESETS
from specbench.plan.explore import cost_column, recommend
from specbench.viz.figures import pareto_figure


def write_pareto_report(path: Path | str, sections: Sequence[dict], cost: str = "total_cost",
                        note: str = "") -> Path:
    """Each section: {"title", "predicted" (DataFrame), optional "measured" (DataFrame), optional "cs"}.

    Per section: the Pareto figure (predicted points, front, measured overlay, recommended point for
    the section's cs), the recommendation for each preset, and the predicted table.
    """
    column = cost_column(cost)
    parts, first = [], True
    for section in sections:
        predicted: pd.DataFrame = section["predicted"]
        measured: Optional[pd.DataFrame] = section.get("measured")
        cs = float(section.get("cs", PRESETS["balanced"]))
        best = recommend(predicted, cs, cost)
        figure = pareto_figure(predicted, measured, cost=column, recommended=best,
                               title=f"{section['title']} (recommended at cs={cs:g}: {best['label']})",
                               by="variant" if "variant" in predicted else "method")
        parts.append(f"<h2>{html.escape(section['title'])}</h2>")
        parts.append(figure.to_html(full_html=False, include_plotlyjs="inline" if first else False,
                                    div_id=f"pareto-{len(parts)}"))
        first = False
        picks = [{"preset": name, "cs": value, **recommend(predicted, value, cost)[
            ["label", "tokens_per_s", column]].to_dict()} for name, value in PRESETS.items()]
        parts.append("<h3>Recommended operating point per preset</h3>" + pd.DataFrame(picks).to_html(
            index=False, float_format=lambda v: f"{v:.4g}"))
        shown = predicted[["label", "tokens_per_step", "tokens_per_s", "step_ms", column, "bytes_per_token",
                           "on_front"]].sort_values("tokens_per_s", ascending=False)
        parts.append("<details><summary>All predicted operating points</summary>"
                     + shown.to_html(index=False, float_format=lambda v: f"{v:.4g}") + "</details>")
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    body = "\n".join(parts)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>specbench Pareto report</title>"
            f"<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} "
            f"td,th{{padding:2px 8px;border-bottom:1px solid #ddd}}</style></head><body>"
            f"<h1>specbench Pareto report</h1><p>Generated {stamp}. Predicted points replay cached latency "
            f"profiles and acceptance references; measured points (diamonds) come from runs. "
            f"{html.escape(note)}</p>{body}</body></html>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
