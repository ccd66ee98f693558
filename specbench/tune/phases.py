"""The work of a tune, each phase resumable from its folder: profiles, references, measurements.

Why files per phase: a tune runs for minutes and may be killed; a rerun reads what a phase already
wrote (a profile of the same model, machine and grid; a reference of the same pair and prompt split;
a measurement of the same point) and does only the rest.
"""
from __future__ import annotations

import hashlib
import io
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pandas as pd

from specbench.hardware import device_name, on_worker, target_device
from specbench.files import replacing
from specbench.plan.library import load_profiles, load_references, save_profile, save_reference
from specbench.plan.predict import LatencyProfile
from specbench.tune.spec import FREE, Candidate, TuneSpec


MACHINES = "machines.json"  # in measured/: the machine that measured each point, and when


class Store:
    """The tune's folder: `profiles/`, `reference/` and `measured/*.json`. `machine` (`hardware.machine_of`): measured
    points are filed with it, and one measured on another machine is measured again, not read: a folder in a
    home shared by machines (or a user cache moved to another CPU) held speeds that were not this machine's.
    `read_back`: {point: when it was measured} of the points read from the folder, not measured by this Store."""

    def __init__(self, folder: Path, machine: Optional[str] = None):
        self.folder, self.machine, self.read_back = Path(folder), machine, {}
        for name in ("profiles", "reference", "measured"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)

    def _machines(self) -> dict:
        """{point: {"machine", "at"}}, as the file holds it now (another tune here may have written it)."""
        path = self.folder / "measured" / MACHINES
        try:
            index = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            index = {}  # damaged: its points read as measured on an unknown machine, as before there was one
        return index if isinstance(index, dict) else {}

    def _entry(self, key: str) -> dict:
        entry = self._machines().get(key)
        return entry if isinstance(entry, dict) else {}

    def _foreign(self, entry: dict) -> Optional[str]:
        """The other machine that measured the point of `entry` (`_entry`), if one did."""
        other = entry.get("machine")
        return other if self.machine and other and other != self.machine else None

    def holds(self, key: str) -> bool:
        """Whether a measurement of `key` is stored that this machine may read."""
        return (self.folder / "measured" / f"{key}.json").exists() and self._foreign(self._entry(key)) is None

    def profile(self, model: str, dtype: str, grid: dict, device: str) -> Optional[LatencyProfile]:
        found = [p for p in load_profiles(self.folder / "profiles", model=model, dtype=dtype, device=device,
                                          grid=_key(grid))]
        return found[0] if found else None

    def save_profile(self, profile: LatencyProfile, extra: dict, grid: dict) -> None:
        save_profile(profile, {**extra, "grid": _key(grid)}, folder=self.folder / "profiles")

    def reference(self, draft: str, target: str, dataset: str):
        found = load_references(self.folder / "reference", draft=draft, target=target, dataset=dataset)
        return found[0] if found else None

    def save_reference(self, reference, extra: dict) -> None:
        save_reference(reference, extra, folder=self.folder / "reference")

    def measured(self, key: str) -> Optional[pd.DataFrame]:
        """A point's stored records; a file that is not a list of records (damaged, edited) is said and the
        point measured again (the file is written whole, so a kill cannot leave one)."""
        path = self.folder / "measured" / f"{key}.json"
        if not path.exists():
            return None
        entry = self._entry(key)
        if (other := self._foreign(entry)) is not None:
            print(f"specbench: tune's measurement {path} was taken on {other}, not this machine ({self.machine}); "
                  f"measuring that point again", file=sys.stderr)
            return None
        try:
            text = path.read_text()
            rows = json.loads(text)
            if isinstance(rows, list) and rows and all(isinstance(row, dict) for row in rows):
                at = entry.get("at")
                self.read_back.setdefault(key, float(at) if at is not None else path.stat().st_mtime)
                return pd.read_json(io.StringIO(text), orient="records")  # as written: dtypes read back alike
            why = "not a list of records"
        except (OSError, ValueError) as error:
            why = str(error)
        print(f"specbench: tune's measurement {path} is unreadable ({why}); measuring that point again",
              file=sys.stderr)
        return None

    def save_measured(self, key: str, records: pd.DataFrame) -> None:
        path = self.folder / "measured" / f"{key}.json"
        with replacing(path) as temporary:  # whole or absent: a kill mid-write leaves no half record
            records.to_json(temporary, orient="records", double_precision=15)  # (pandas keeps 10 decimals)
        self.read_back.pop(key, None)
        if self.machine:
            index = dict(self._machines(), **{key: {"machine": self.machine, "at": time.time()}})
            with replacing(self.folder / "measured" / MACHINES) as temporary:
                Path(temporary).write_text(json.dumps(index, indent=0, sort_keys=True))


def _key(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def point_key(spec: TuneSpec, candidate: Candidate, method: str, k: int, prompts: list, clients: int = 1,
              suffix: Optional[dict] = None) -> str:
    """`suffix`: suffix decoding's settings changed for the point (a hybrid's, `tune/hybrid.py`)."""
    point = {"target": spec.target, "endpoint": spec.endpoint, "candidate": candidate.name, "method": method,
             "k": k, "prompts": prompts, "tokens": spec.max_new_tokens, "dtype": spec.dtype, "seed": spec.seed}
    if suffix:
        point["suffix"] = dict(sorted(suffix.items()))
    if spec.kernels != "default":  # (points measured before kernels were a choice keep their keys)
        point["kernels"] = spec.kernels
    if spec.sampling() is not None:  # (and greedy points from before sampled tunes theirs)
        point["sampling"] = spec.sampling_tag
    return _key({**point, "clients": clients} if clients > 1 else point)


def stored_points(store: Store, predicted: pd.DataFrame, spec: TuneSpec, prompts: list, method_of) -> list[dict]:
    """The predicted points whose records this folder holds for these prompts and settings: an earlier tune
    here measured them (another cs or objective, a killed run), so they cost a read. `method_of(row)` gives
    (candidate, method)."""
    found = []
    for row in predicted.to_dict("records"):
        candidate, method = method_of(row)
        key = point_key(spec, candidate, method, int(row["k"]), prompts, int(row["clients"]))
        if store.holds(key):
            found.append(row)
    return found


def profile(store: Store, model, grid: dict, spec: TuneSpec, progress, label: Optional[str] = None) -> LatencyProfile:
    """`model`'s latency over `grid` on this machine (or the worker's, for a RemoteTarget), cached; a draft
    head's (its own forward over the grid's tokens and contexts) under `label`."""
    from specbench.record import profile_model, profile_worker

    if label is not None:
        return _head_profile(store, model, grid, spec, progress, label)
    remote = on_worker(model)
    device = target_device(model)
    label = model.info["model"] if remote else model.spec.label
    found = store.profile(label, spec.dtype, grid, device)
    if found is not None:
        return found
    if remote:
        measured, extra = profile_worker(model.endpoint, **grid, repeats=spec.repeats)
    else:
        measured, extra = profile_model(model, **grid, repeats=spec.repeats, progress=progress)
    store.save_profile(measured, extra, grid)
    return store.profile(measured.model, spec.dtype, grid, measured.device) or measured


def _head_profile(store: Store, head, grid: dict, spec: TuneSpec, progress, label: str) -> LatencyProfile:
    from specbench.heads.profile import profile_head

    device = device_name(str(head.lm_head.weight.device))
    found = store.profile(label, spec.dtype, grid, device)
    if found is not None:
        return found
    measured, extra = profile_head(head, label, tokens=grid["tokens"], contexts=grid["contexts"], repeats=spec.repeats,
                                   progress=progress)
    store.save_profile(measured, extra, grid)
    return store.profile(label, spec.dtype, grid, device) or measured


def reference(store: Store, target, candidate: Candidate, draft, prompts: list, dataset: str, spec: TuneSpec,
              progress):
    """The pair's acceptance on the calibration prompts, cached; per-step rows as every reference keeps."""
    from specbench.heads.profile import head_label
    from specbench.models.spec import acceptance_label
    from specbench.record import record_reference

    free = candidate.method in FREE  # prompt lookup, suffix decoding: the reference's draft is the method
    head = candidate.method == "eagle"  # a head's folder: recorded as `eagle:<folder>`, its eagle chains and trees
    draft_label = (candidate.method if free else head_label(candidate.draft) if head
                   else acceptance_label(draft.spec.label))
    target_label = acceptance_label(target.spec.label)
    found = store.reference(draft_label, target_label, dataset)
    if found is not None:
        return found
    recorded = record_reference(target, candidate.method if free else candidate.draft if head else draft, prompts,
                                dataset=dataset, max_chain=max(spec.chain_ks), tree_budgets=spec.tree_budgets,
                                max_new_tokens=spec.max_new_tokens, dtype=spec.dtype, sampling=spec.sampling(),
                                progress=f"tune: reference {candidate.name}" if progress else False)
    store.save_reference(recorded, {"prompts": len(prompts)})
    return store.reference(draft_label, target_label, dataset) or recorded


def run_options(candidate: Candidate, draft, spec: TuneSpec, target) -> dict:
    """What `run` takes to measure `candidate` (all but method and K): its draft (a model loaded, a head by its
    folder), its layer count or quantization where it has one, and the tune's settings. A substitute's
    quantization is given only for a substitute, so two candidates' options merge into one call."""
    from specbench.decode.suffix_drafter import SuffixSettings

    models = {"chain": draft, "tree": draft, "eagle": candidate.draft}  # a head: its folder, loaded by the drafter
    options = dict(draft=models.get(candidate.method), max_new_tokens=spec.max_new_tokens,
                   self_draft_layers=candidate.self_draft_layers, dtype=spec.dtype, seed=spec.seed, warmup=False,
                   tokenizer=getattr(target, "tokenizer", None), sampling=spec.sampling(),
                   suffix=SuffixSettings(cache="drafter"))  # suffix decoding's cache: this run's prompts only
    if candidate.method == "substitute":
        options["substitute_quantization"] = candidate.quantization
    return options


def measure(store: Store, target, candidate: Candidate, method: str, k: int, prompts: list, draft, spec: TuneSpec,
            progress, clients: int = 1, suffix: Optional[dict] = None) -> pd.DataFrame:
    """Records of `method` at `k` on the held-back prompts, cached per point; `clients` above 1 decode at
    once against the worker `target` talks to (`together`), with a `client` column. Through a worker, a
    model draft is recorded at one client and replayed at more (`decode/replay_drafter.py`: the users'
    drafts run on their own devices, not on the cores this box's worker needs). `suffix`: suffix decoding's
    settings changed for this point (a hybrid's)."""
    key = point_key(spec, candidate, method, k, prompts, clients, suffix)
    # a model draft on a worker records its proposals for loaded points (greedy only: `spec.check_sampled_load`)
    drafting = (bool(spec.endpoint) and candidate.method not in FREE and method != "target-only"
                and spec.sampling() is None)
    # the draft's proposals, kept beside its one-client point: written there, replayed at more clients
    alone_key = point_key(spec, candidate, method, k, prompts, 1, suffix)
    proposals_path = store.folder / "measured" / f"{alone_key}.proposals.json"
    found = store.measured(key)
    if found is not None and not (drafting and clients == 1 and not proposals_path.exists()):
        return found
    from specbench.decode.replay_drafter import RecordingDrafter, load_proposals, save_proposals

    label = f"tune: measure {candidate.name} {method} k={k}" + (f", {clients} clients" if clients > 1 else "")
    job = dict(method=method, k=k, **run_options(candidate, draft, spec, target))
    if suffix:
        job["suffix"] = replace(job["suffix"], **suffix)
    if clients > 1:
        proposals = None
        if drafting:  # the draft alone first (one client), then replayed by every client
            measure(store, target, candidate, method, k, prompts, draft, spec, progress, suffix=suffix)
            proposals = load_proposals(proposals_path)
        records = together(target.endpoint, clients, prompts, job, label if progress else False, proposals)
    else:
        from specbench.api import run

        recorded: dict = {}
        wrap = (lambda drafter: RecordingDrafter(drafter, recorded)) if drafting else None  # noqa: E731
        records = run(target, prompts, **job, progress=label if progress else False, wrap_drafter=wrap)
        if drafting:
            save_proposals(proposals_path, recorded)
    # target-only keeps its tokens: the held-back prompts' acceptance is replayed from them (`tune/replay.py`)
    dropped = ("tree_widths",) if method == "target-only" else ("emitted_tokens", "tree_widths")
    records = records.drop(columns=[c for c in dropped if c in records])
    store.save_measured(key, records)
    return records


def together(endpoint: str, clients: int, prompts: list, job: dict, progress, proposals: Optional[dict] = None
             ) -> pd.DataFrame:
    """`clients` clients decoding at once against the worker at `endpoint`, each its own connection and
    drafter, released together; each decodes the same number of prompts (client c takes prompts c,
    c + clients, ..., wrapping round), so batches stay full but for the last steps' tail. With recorded
    `proposals` each client replays them (a `replay_misses` column counts contexts never met alone, drafted for
    real where the drafter can: `ReplayDrafter`).
    Why threads, not processes: a client spends its step waiting on the worker (the socket wait releases
    the GIL) or in the draft's torch ops (which release it too); one loaded draft serves them all."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from specbench.api import run
    from specbench.decode.replay_drafter import ReplayDrafter
    from specbench.tune.loaded import deal
    from specbench.worker.client import RemoteTarget

    start = threading.Barrier(clients)

    def client(index: int) -> pd.DataFrame:
        chosen = deal(len(prompts), clients, index)
        remote = RemoteTarget(endpoint, timeout_s=120, retries=0)
        replays: list = []

        def replayed(drafter):
            replays.append(ReplayDrafter(proposals, draft=getattr(drafter, "draft", None), fallback=drafter))
            return replays[-1]

        start.wait()
        records = run(remote, [prompts[i] for i in chosen], **job, progress=progress if index == 0 else False,
                      wrap_drafter=replayed if proposals is not None else None)
        return records.assign(prompt_index=[chosen[i] for i in records["prompt_index"]], client=index,
                              replay_misses=sum(replay.misses for replay in replays))

    with ThreadPoolExecutor(clients) as pool:
        return pd.concat(list(pool.map(client, range(clients))), ignore_index=True)
