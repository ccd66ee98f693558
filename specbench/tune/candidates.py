"""Which drafts a tune compares: the ones named, or every draft that could serve the target ("auto").

"auto" means: prompt lookup and suffix decoding (free), a self-draft of a quarter of the target's layers, the target
quantized as its own substitute (int8-dynamic on a CPU, 8-bit on a GPU), and every embedded catalog
model smaller than the target, of its family or another (another tokenizer is drafted through text).
A name that cannot be resolved is refused before any work: an unknown model is not an embedded name, a
local path, a tiny test model or a Hugging Face id cached on this machine.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from specbench.tune.spec import FREE, LOOKUP, SUFFIX, Candidate, TuneSpec, candidate
from specbench.types import SpecbenchError


def check_drafts(spec: TuneSpec) -> None:
    """Refuse a named draft that cannot be found, before anything is loaded or measured."""
    for name in spec.drafts:
        if name != "auto":
            _check(candidate(name))


def resolve_candidates(spec: TuneSpec, target) -> tuple[list[Candidate], list[str]]:
    """(candidates, notes on what was left out and why), in the order the report lists them."""
    layers = getattr(target.model.config, "num_hidden_layers", 4)
    names = list(spec.drafts)
    if "auto" in names:
        names.remove("auto")
        names += _auto(spec, target)
    notes, out = [], []
    for name in dict.fromkeys(names):
        chosen = candidate(name, layers)
        _check(chosen)
        if spec.endpoint and chosen.method in ("self-draft", "substitute"):
            notes.append(f"{chosen.name}: left out, it drafts with the target's own weights, which run on the worker")
            continue
        out.append(chosen)
    if not out:
        raise SpecbenchError(f"no candidate draft to tune for {spec.target!r}: name some with --drafts")
    return out, notes


def _auto(spec: TuneSpec, target) -> list[str]:
    from specbench.models.catalog import CATALOG

    names = [LOOKUP, SUFFIX, "self-draft"]
    device = str(target.model.get_input_embeddings().weight.device)
    names.append("substitute:int8-dynamic" if device == "cpu" and spec.dtype == "float32" else "substitute:8bit")
    own = CATALOG.get(spec.target)
    if own is not None:
        names += [name for name, entry in CATALOG.items() if name != spec.target and entry.size < own.size]
    return names


def _check(chosen: Candidate) -> None:
    """A candidate's draft is there: a head's folder holds a head, a model is known or on disk."""
    if chosen.method == "eagle":
        _check_head(chosen.draft)
    elif chosen.draft is not None:
        _check_model(chosen.draft)


def _check_head(folder: str) -> None:
    from specbench.heads.profile import is_head

    if not is_head(folder):
        raise SpecbenchError(f"draft head {folder!r}: not a folder holding a head's config.json (write one with "
                             f"`specbench train-draft --out FOLDER`, or give a published EAGLE-3 head's folder)")


def _check_model(name: str) -> None:
    from specbench.models.catalog import CATALOG

    if name in CATALOG or name.startswith("tiny-random") or Path(name).expanduser().exists():
        return
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means the same to the user: no such model here
        raise SpecbenchError(f"unknown draft {name!r}: not an embedded model ({sorted(CATALOG)}), a local path, a "
                             f"tiny-random name, or a Hugging Face model cached on this machine") from None


def head_label(candidate) -> Optional[str]:
    """A head's name in profiles and references (`eagle:<folder>`); None for any other candidate."""
    from specbench.heads.profile import head_label as label

    return label(candidate.draft) if candidate.method == "eagle" else None


def draft_model(candidate, target, spec: TuneSpec):
    """`candidate`'s draft, loaded once for the whole tune: none for prompt lookup and suffix decoding, a head
    over `target`, a view of the target's first layers, the target quantized, or a model of its own."""
    from specbench.models.loading import load_model
    from specbench.models.self_draft import truncated_view
    from specbench.models.spec import ModelSpec

    if candidate.method in FREE:
        return None
    if candidate.method == "eagle":
        from specbench.heads.layouts import load_head

        return load_head(candidate.draft, target)
    if candidate.method == "self-draft":
        return truncated_view(target, candidate.self_draft_layers)
    if candidate.method == "substitute":
        return load_model(target.spec.quantized(candidate.quantization))
    return load_model(ModelSpec(candidate.draft, dtype=spec.dtype, kernels=spec.kernels))
