"""What the cached profiles predict for each setting a server offers: tokens/s and $ per 1M tokens.

The chat page shows it beside what a reply measured, so a user sees whether this machine runs the
setting as the cache says. Only settings a cached profile and reference cover on one device get a
row (the served target's device first, and whether it is that device said); the rest are named as not
covered rather than guessed.
"""
from __future__ import annotations

from typing import Optional, Sequence

from specbench.methods import get_method, kind_method
from specbench.types import SpecbenchError


def predicted_settings(target: str, draft: Optional[str], methods: Sequence[str], ks: Sequence[int],
                       dtype: str = "float32", device: Optional[str] = None) -> dict:
    """{"<method> k=<k>": {tokens_per_s, usd_per_mtok, device, here}} or {...: {"missing": why}} per setting.
    `device`: the name of the device the served target runs on (`hardware.target_device`); `here` says whether
    the prediction was profiled on it (None where `device` is unknown)."""
    from specbench.plan.explore import cached_pairs, prediction_frame
    from specbench.plan.library import load_library
    from specbench.plan.predict import LOOKUP_DRAFT, SUFFIX_DRAFT, OperatingPoint
    from specbench.plan.reference import HYBRIDS

    profiles, references = load_library()
    out = {}
    for name in methods:
        method = get_method(name)
        sizes = [0] if method.kind == "none" else list(ks)
        drafted_by = None if method.kind == "none" else draft if not method.lookup else (
            SUFFIX_DRAFT if name.startswith("suffix") else LOOKUP_DRAFT)  # suffix decoding: its own reference
        pairs = cached_pairs(profiles, references, target, drafted_by, dtype=dtype, prefer=device)
        hybrid = name.removesuffix("-server") in HYBRIDS  # priced from its own recorded steps, never as a tree
        pair = next(iter([p for p in pairs if hybrid and p[2].prices_hybrid(name)] or pairs), None)
        for k in sizes:
            label = name if method.kind == "none" else f"{name} k={k}"
            if pair is None:
                out[label] = {"missing": f"no cached profile and reference for {target} with "
                                         f"{drafted_by or 'no draft'} (specbench profile / reference)"}
                continue
            target_profile, draft_profile, reference = pair
            if hybrid and not reference.prices_hybrid(name):
                out[label] = {"missing": f"the cached reference of {target} with {drafted_by} holds no steps of "
                                         f"{name} (specbench reference --hybrid {k})"}
                continue
            try:
                row = prediction_frame(target_profile, draft_profile, reference,
                                       points=[OperatingPoint(name if hybrid else kind_method(method.kind), k)]).iloc[0]
            except SpecbenchError as error:
                out[label] = {"missing": str(error)}
                continue
            out[label] = {"tokens_per_s": round(float(row["tokens_per_s"]), 2),
                          "usd_per_mtok": round(float(row["total_cost_usd_per_mtok"]), 4),
                          "device": target_profile.device,
                          "here": None if device is None else target_profile.device == device}
    return out
