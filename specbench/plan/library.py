"""Plan inputs on disk: LatencyProfile and AcceptanceReference records in profiles/ and reference/, and
measured speedups under concurrency beside the references (what predictions are checked against).

Two homes, never mixed silently: the shipped folders (`PROFILES`, `REFERENCES`: curated, in the
package) and the user's own (`OWN_PROFILES`, `OWN_REFERENCES`, under the user cache), where
`save_*` writes unless told otherwise. Every loaded record carries its origin and sitting, and a
profile how much its repeats spread (`NOISY_SPREAD` and over: taken on a busy machine).
"""
from __future__ import annotations

import platform
from dataclasses import asdict
from datetime import datetime, timezone
from importlib import metadata as package_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from specbench.cache.store import find_records, write_record
from specbench.data_paths import data_folder, user_folder
from specbench.plan.predict import AcceptanceReference, LatencyProfile

if TYPE_CHECKING:  # pandas only where measured rows are read or written: this module loads with the stdlib
    import pandas as pd

PROFILES = data_folder("profiles")
REFERENCES = data_folder("reference")
OWN_PROFILES = user_folder("profiles")
OWN_REFERENCES = user_folder("reference")
# a profile whose repeats spread this much ((max - min) / median, the median over its points) was taken
# while something else ran: on a quiet 2-core box the spread stays under ~0.1
NOISY_SPREAD = 0.3


def library_versions() -> dict:
    versions = {}
    for name in ("torch", "transformers", "bitsandbytes", "specbench-lab"):
        try:
            versions[name] = package_metadata.version(name)
        except package_metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _stamped(metadata: dict, extra: Optional[dict] = None) -> dict:
    """A record's metadata with the library versions, any `extra`, and today's date unless given."""
    stamped = {**metadata, "versions": library_versions(), **(extra or {})}
    stamped.setdefault("date", datetime.now(timezone.utc).date().isoformat())
    return stamped


def origin_of(folder: Path | str) -> str:
    """"shipped" for the package's own folders, "own" for any other."""
    return "shipped" if Path(folder).resolve() in (PROFILES.resolve(), REFERENCES.resolve()) else "own"


def is_noisy(profile: LatencyProfile) -> bool:
    return profile.noise is not None and profile.noise >= NOISY_SPREAD


def save_profile(profile: LatencyProfile, extra: Optional[dict] = None, folder: Path = OWN_PROFILES) -> Path:
    """Write `profile` to `folder` (the user's own by default); a noisy one is kept, flagged and warned
    about: notebook 03 shows the flag and never pairs it silently with a quiet one."""
    metadata = _stamped({"model": profile.model, "device": profile.device, "dtype": profile.dtype,
                         "quantization": profile.quantization, "weight_bytes": profile.weight_bytes,
                         "kv_bytes_per_token": profile.kv_bytes_per_token, "forward": profile.forward,
                         "host": platform.node(), "spread": profile.noise}, extra)
    if is_noisy(profile):
        import warnings

        warnings.warn(f"profile of {profile.model}: its repeats spread {profile.noise:.2f} (>= {NOISY_SPREAD}): the "
                      f"machine was busy while it ran; it is saved flagged 'busy', so measure again on a quiet machine",
                      stacklevel=2)
    payload = {"rows": [list(row) for row in profile.rows]}
    fast = "" if profile.forward == "eager" else f"-{profile.forward}"
    return write_record(folder, "profile", metadata, payload,
                        label=f"{profile.model}-{profile.dtype}{fast}-{profile.device}")


def load_profiles(folder: Path = PROFILES, **match) -> list[LatencyProfile]:
    origin = origin_of(folder)
    return [LatencyProfile(model=m["model"], device=m["device"], dtype=m["dtype"], quantization=m["quantization"],
                           rows=tuple(tuple(row) for row in p["rows"]), weight_bytes=m.get("weight_bytes") or 0,
                           kv_bytes_per_token=m.get("kv_bytes_per_token") or 0, forward=m.get("forward", "eager"),
                           origin=origin, sitting=f"{m.get('date', '')} {m.get('host', '')}".strip(),
                           noise=m.get("spread"))
            for _, m, p in find_records(folder, "profile", **match)]


def load_library(own: bool = True, by_family: bool = False) -> tuple[list[LatencyProfile], list[AcceptanceReference]]:
    """Every profile and reference: the shipped ones, and the user's own unless `own` is False; `by_family`:
    each reference's recorded families also as references of their own ("<dataset>/<family>")."""
    profiles, references = load_profiles(PROFILES), load_references(REFERENCES, by_family)
    if own and OWN_PROFILES.resolve() != PROFILES.resolve():
        profiles += load_profiles(OWN_PROFILES)
        references += load_references(OWN_REFERENCES, by_family)
    return profiles, references


def save_reference(reference: AcceptanceReference, extra: Optional[dict] = None,
                   folder: Path = OWN_REFERENCES) -> Path:
    fields = asdict(reference)
    metadata = {key: fields[key] for key in ("draft", "target", "dataset", "rule", "temperature", "max_chain")}
    if reference.cross_tokenizer:
        metadata.update(cross_tokenizer=reference.cross_tokenizer, draft_per_target=reference.draft_per_target)
    if reference.chain_hits:
        metadata.update(chain_hits={str(k): v for k, v in reference.chain_hits.items()})
    if reference.feature_bytes:
        metadata.update(feature_bytes=reference.feature_bytes)
    if reference.hybrid_method:
        metadata.update(hybrid_method=reference.hybrid_method, hybrid_settings=reference.hybrid_settings,
                        hybrid_width=reference.hybrid_width)
    metadata = _stamped(metadata, extra)
    payload = {"chain_accepts": list(reference.chain_accepts),
               "tree_accepts": {str(k): list(v) for k, v in reference.tree_accepts.items()},
               "tree_depth": {str(k): v for k, v in reference.tree_depth.items()},
               "tree_width": {str(k): v for k, v in reference.tree_width.items()},
               "chain_prompts": list(reference.chain_prompts),
               "tree_prompts": {str(k): list(v) for k, v in reference.tree_prompts.items()},
               "prompt_families": list(reference.prompt_families),
               "steps_at_k": {str(k): [list(step) for step in v] for k, v in reference.steps_at_k.items()},
               "steps_prompts": {str(k): list(v) for k, v in reference.steps_prompts.items()},
               "tree_steps": {str(k): [list(step) for step in v] for k, v in reference.tree_steps.items()},
               "tree_steps_prompts": {str(k): list(v) for k, v in reference.tree_steps_prompts.items()},
               "hybrid_steps": {str(k): [list(step) for step in v] for k, v in reference.hybrid_steps.items()},
               "hybrid_prompts": {str(k): list(v) for k, v in reference.hybrid_prompts.items()}}
    return write_record(folder, "reference", metadata, payload,
                        label=f"{reference.draft}-{reference.target}-{reference.dataset}")


def load_references(folder: Path = REFERENCES, by_family: bool = False, **match) -> list[AcceptanceReference]:
    """Every reference in `folder` (matching `match`); `by_family`: also each recorded family's own."""
    out, origin = [], origin_of(folder)
    for _, m, p in find_records(folder, "reference", **match):
        out.append(AcceptanceReference(
            draft=m["draft"], target=m["target"], dataset=m["dataset"], rule=m["rule"],
            temperature=m["temperature"], max_chain=m["max_chain"], chain_accepts=tuple(p["chain_accepts"]),
            tree_accepts={int(k): tuple(v) for k, v in p["tree_accepts"].items()},
            tree_depth={int(k): v for k, v in p["tree_depth"].items()},
            tree_width={int(k): v for k, v in p["tree_width"].items()},
            cross_tokenizer=m.get("cross_tokenizer", ""), draft_per_target=m.get("draft_per_target", 1.0),
            chain_hits={int(k): v for k, v in (m.get("chain_hits") or {}).items()}, origin=origin,
            chain_prompts=tuple(p.get("chain_prompts", ())),
            tree_prompts={int(k): tuple(v) for k, v in (p.get("tree_prompts") or {}).items()},
            prompt_families=tuple(p.get("prompt_families", ())), feature_bytes=int(m.get("feature_bytes", 0)),
            steps_at_k={int(k): tuple(tuple(step) for step in v) for k, v in (p.get("steps_at_k") or {}).items()},
            steps_prompts={int(k): tuple(v) for k, v in (p.get("steps_prompts") or {}).items()},
            tree_steps={int(k): tuple(tuple(step) for step in v) for k, v in (p.get("tree_steps") or {}).items()},
            tree_steps_prompts={int(k): tuple(v) for k, v in (p.get("tree_steps_prompts") or {}).items()},
            hybrid_method=m.get("hybrid_method", ""), hybrid_settings=dict(m.get("hybrid_settings") or {}),
            hybrid_width=int(m.get("hybrid_width", 1)),
            hybrid_steps={int(k): tuple(tuple(step) for step in v) for k, v in (p.get("hybrid_steps") or {}).items()},
            hybrid_prompts={int(k): tuple(v) for k, v in (p.get("hybrid_prompts") or {}).items()}))
    if by_family:  # each family of a reference as a reference of its own, beside the whole
        out += [reference.for_family(family) for reference in list(out) for family in reference.families()]
    return out


MEASURED_COLUMNS = ("clients", "series", "speedup", "tokens_per_s", "target_only_tokens_per_s")


def save_concurrency(measured: pd.DataFrame, metadata: dict, folder: Path = OWN_REFERENCES) -> Path:
    """SD's measured speedup over target-only per number of clients sharing one worker (`MEASURED_COLUMNS`,
    from `benchmarks/concurrency.py --save-measured`); `metadata` names target, draft, device, dtype and
    the load. Notebook 03 draws them beside the predicted curve of the same pair."""
    metadata = _stamped(metadata)
    payload = {"rows": measured.loc[:, list(MEASURED_COLUMNS)].to_dict("records")}
    return write_record(folder, "concurrency", metadata, payload, label=f"{metadata['draft']}-{metadata['target']}")


def load_concurrency(folder: Path = REFERENCES, **match) -> pd.DataFrame:
    """Every measured row whose record matches (e.g. target=..., draft=...), with the record's pair,
    device, dtype, load and date; its series names the machine and setting too, so runs on different machines or
    under different loads stay apart."""
    keys = ("target", "draft", "device", "dtype", "load", "date")
    rows = [{**row, "series": f"{row['series']} ({m['device']}, {m['dtype']}, {m['load']})", **{k: m[k] for k in keys}}
            for _, m, p in find_records(folder, "concurrency", **match) for row in p["rows"]]
    import pandas as pd

    return pd.DataFrame(rows, columns=[*MEASURED_COLUMNS, *keys])
