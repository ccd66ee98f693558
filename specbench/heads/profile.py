"""A head's latency profile and acceptance reference: what the planner needs to price it like any draft.

Why its own profile: a head is not a model with a KV cache of the target's shape; what a drafting step
costs is the head's forward over n new positions after a cache of c (the first feeds the positions the
last verify committed, the rest one drafted token each), timed here over the same grid as a model's.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from specbench.heads.model import EagleHead, HeadCache
from specbench.plan.predict import LatencyProfile


def head_label(where) -> str:
    """How profiles and references name a head: `eagle:<its folder's name>` (the folder above a `head`
    folder, as `train-draft --out <name>` writes it)."""
    from pathlib import Path

    if isinstance(where, EagleHead):
        return "eagle:head"
    path = Path(str(where)).expanduser()
    return f"eagle:{path.parent.name if path.name == 'head' and path.parent.name else path.name}"


@torch.inference_mode()
def profile_head(head: EagleHead, label: str, tokens: Sequence[int] = (1, 2, 3, 4, 5, 6, 8),
                 contexts: Sequence[int] = (128, 512), repeats: int = 5, warmup: int = 2,
                 progress: bool = False) -> tuple[LatencyProfile, dict]:
    """Median seconds of the head's forward of n new positions on a cache of c, over the grid."""
    from tqdm.auto import tqdm

    from specbench.hardware import device_name
    from specbench.decode.profile import spread

    weight = head.lm_head.weight
    width = head.fc.in_features
    generator = torch.Generator().manual_seed(0)
    rows = []
    grid = [(n, c) for c in contexts for n in tokens]
    for n, context in tqdm(grid, desc=f"profile {label}", unit="point", disable=not progress):
        cache = HeadCache()
        raw = torch.randn(context + n, width, generator=generator).to(weight.device, weight.dtype)
        ids = torch.randint(0, head.config.vocab_size, (context + n,), generator=generator).to(weight.device)
        head(ids[:context], head.fuse(raw[:context]), torch.arange(context, device=weight.device), cache)
        times = []
        for repeat in range(warmup + repeats):
            started = time.perf_counter()
            head(ids[context:], head.fuse(raw[context:]), torch.arange(context, context + n, device=weight.device),
                 cache)
            if weight.is_cuda:
                torch.cuda.synchronize(weight.device)
            if repeat >= warmup:
                times.append(time.perf_counter() - started)
            cache.keep(context)
        rows.append({"tokens": n, "context": context, "batch": 1, "median_s": statistics.median(times),
                     "min_s": min(times), "max_s": max(times)})
    weight_bytes = sum(p.numel() * p.element_size() for name, p in head.named_parameters()
                       if not (name.startswith("embed_tokens") and getattr(head, "shares_embeddings", False)))
    profile = LatencyProfile(model=label, device=device_name(str(weight.device)), dtype=str(weight.dtype)[6:],
                             weight_bytes=weight_bytes, rows=tuple((r["tokens"], r["context"], r["median_s"], 1)
                                                                   for r in rows), noise=spread(rows))
    return profile, {"repeats": repeats, "threads": torch.get_num_threads(), "power_source": "none",
                     "power_watts": None}


def head_feature_bytes(draft) -> int:
    """Bytes of one position's feature row as a worker sends it to a client-side head (float16, the layers'
    inputs side by side): what that placement adds to a verify reply per committed position."""
    from pathlib import Path

    if isinstance(draft, EagleHead):
        return 2 * draft.config.feature_width
    from specbench.heads.layouts import read_config

    config, _ = read_config(Path(draft).expanduser())
    return 2 * config.feature_width


def is_head(draft) -> bool:
    """A draft that is a head (an EagleHead, or a folder whose config is a head's), not a model."""
    from pathlib import Path

    if isinstance(draft, EagleHead):
        return True
    if not isinstance(draft, (str, Path)) or not (Path(draft).expanduser() / "config.json").exists():
        return False
    from specbench.heads.layouts import read_config
    from specbench.types import SpecbenchError

    try:
        read_config(Path(draft).expanduser())
    except SpecbenchError:
        return False
    return True
