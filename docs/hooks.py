"""MkDocs hooks: the CLI reference generated from the parser, and the dated result pages of
`benchmarks/results/` published under `results/` (they live beside the benchmarks, not in docs/)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def on_config(config):
    """The Results section lists every dated page, newest first, after its index."""
    pages = [{_plain(p.read_text().split("\n", 1)[0].lstrip("# ").strip())[:60]: f"results/{p.name}"}
             for p in sorted(RESULTS.glob("*.md"), reverse=True)]
    config["nav"] = [{"Results": ["results.md", *pages]} if item == {"Results": "results.md"} else item
                     for item in config["nav"]]
    return config


def on_files(files, config):
    for path in sorted(RESULTS.glob("*.md")):
        files.append(File(f"results/{path.name}", src_dir=str(RESULTS.parent), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
        files.get_file_from_path(f"results/{path.name}").abs_src_path = str(path)
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- results-index -->" in markdown:
        markdown = markdown.replace("<!-- results-index -->", results_index())
    return markdown


def cli_reference() -> str:
    from specbench.cli import build_parser

    parser = build_parser()
    parts = [f"```text\n{parser.format_help()}```\n"]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        sub.prog = f"specbench {name}"
        parts.append(f"## `specbench {name}`\n\n```text\n{sub.format_help()}```\n")
    return "\n".join(parts)


def results_index() -> str:
    rows = ["| date | page |", "|---|---|"]
    for path in sorted(RESULTS.glob("*.md"), reverse=True):
        title = path.read_text().split("\n", 1)[0].lstrip("# ").strip()
        rows.append(f"| {path.name[:10]} | [{_plain(title)}](results/{path.name}) |")
    return "\n".join(rows) + "\n"


def _plain(title: str) -> str:
    return re.sub(r"[\[\]|`]", "", title)
