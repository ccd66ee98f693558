"""The main job (`make demo`): the embedded SmolLM2, local and remote SD against target-only, and a
Pareto report from the cached profiles and references with this run's measured points overlaid."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from specbench.api import divergences, run
from specbench.decode.divergence import difference_lines
from specbench.decode.metrics import summarize
from specbench.decode.verdict import speed_verdicts

DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences what a hash map is.",
    "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"",
]


CROSS_TARGET, CROSS_DRAFT = "qwen2.5-coder-1.5b", "smollm2-135m"
# the cross-family row's chain-confident threshold: on a 2-core Zen 4 CPU 0.7 ran 1.17-1.28x target-only where
# the fixed K=6 chain ran 0.92-1.07x (benchmarks/results/2026-12-04-chain-confident.md)
CROSS_STOP_BELOW = 0.7


def main_job(k: int = 4, max_new_tokens: int = 48, dtype: str = "float32", rtt_ms: float = 50.0,
             out_dir: str = "reports", cross_family: bool = True) -> pd.DataFrame:
    """Run every phase, print the comparison table, write the records CSV and the HTML report."""
    from specbench.hardware import device_name
    from specbench.models import catalog
    from specbench.models.loading import load_model
    from specbench.models.notices import quiet_library_notices
    from specbench.models.self_draft import truncated_view
    from specbench.models.spec import ModelSpec

    quiet_library_notices()
    steps = 5 if cross_family else 4
    print(f"[1/{steps}] embedded model SmolLM2-135M-Instruct (fetched and converted once into the user cache)", flush=True)
    catalog.ensure_model("smollm2-135m")
    target = load_model(ModelSpec("smollm2-135m", dtype=dtype))
    print(f"[2/{steps}] local: target-only vs every lossless method, greedy, {dtype} on {device_name('cpu')}",
          flush=True)
    local = run(target, DEMO_PROMPTS, method=["target-only", "prompt-lookup", "self-draft", "substitute"], k=k,
                max_new_tokens=max_new_tokens, self_draft_layers=26, dtype=dtype)
    remote = _remote(truncated_view(target, 26), target.tokenizer, k, max_new_tokens, dtype, rtt_ms, steps)
    records = pd.concat([local.assign(where="local"),
                         remote.assign(where=f"remote (emulated RTT {rtt_ms:g} ms)")], ignore_index=True)
    found = _divergences(target, records, local, DEMO_PROMPTS)
    print(_table(records, found).round(3).to_string(index=False))
    print("(self-draft and remote chain = SmolLM2's first 26 of 30 layers as the draft; substitute = its own "
          "8-bit twin)")
    for where, group in records.groupby("where", sort=False):  # why each method paid or not, from its own steps
        print("\n".join(f"{where}: {sentence}" for sentence in speed_verdicts(group)))
    print("\n".join(difference_lines(found, dtype)))
    if cross_family:
        cross = _cross_family(max(k, 6), dtype, steps)
        records = pd.concat([records, cross.assign(where="local, another family's draft")], ignore_index=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records.to_csv(out / "demo_records.csv", index=False)
    print(f"[{steps}/{steps}] Pareto report from the cached profiles/ and reference/", flush=True)
    report = _write_report(out / "pareto.html", local, dtype, rtt_ms)
    print(f"\nper-step records: {(out / 'demo_records.csv').resolve()}")
    print(f"Pareto report:    {report.resolve()}" if report else "Pareto report: no cached profiles found")
    notebooks = Path(__file__).resolve().parents[1] / "notebooks"
    print(f"notebooks:        {notebooks}  (.venv/bin/jupyter lab notebooks/: their kernel is in .venv)")
    return records


def _remote(draft, tokenizer, k: int, max_new_tokens: int, dtype: str, rtt_ms: float, steps: int) -> pd.DataFrame:
    """Target-only and chain SD against a worker process on loopback, the draft in this process."""
    from specbench.worker.client import NetworkEmulation, RemoteTarget
    from specbench.worker.launch import free_port, spawn_worker

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    print(f"[3/{steps}] remote: a worker on {endpoint}, emulated RTT {rtt_ms:g} ms, the draft here", flush=True)
    worker = spawn_worker(endpoint, "--model", "smollm2-135m", "--dtype", dtype)
    try:
        remote = RemoteTarget(endpoint, network=NetworkEmulation(rtt_ms=rtt_ms))
        return run(remote, DEMO_PROMPTS, method=["target-only", "chain"], draft=draft, k=k,
                   max_new_tokens=max_new_tokens, tokenizer=tokenizer)
    finally:
        worker.terminate()


def _cross_family(k: int, dtype: str, steps: int, max_new_tokens: int = 40) -> pd.DataFrame:
    """Where SD pays on this CPU: a draft about 11x smaller than its target, from another family,
    drafting through text (SmolLM2's tokenizer is not Qwen's). In float32 both models run their large
    linear layers on oneDNN where this PyTorch has it: the default fp32 matmul costs ~3x more for the
    few rows a verify has than for one, which alone decides whether the chain pays (`cpu_kernels`)."""
    from specbench.decode.metrics import summarize
    from specbench.models import catalog
    from specbench.models.cpu_kernels import onednn_usable
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    kernels = "onednn" if onednn_usable("cpu", dtype, "none") else "default"
    print(f"[4/{steps}] another family's draft: {CROSS_DRAFT} drafting for {CROSS_TARGET} through text, {dtype}, "
          f"{kernels} kernels (fetched and converted once)", flush=True)
    catalog.ensure_model(CROSS_TARGET)
    target = load_model(ModelSpec(CROSS_TARGET, dtype=dtype, kernels=kernels))
    draft = load_model(ModelSpec(CROSS_DRAFT, dtype=dtype, kernels=kernels))
    prompts = [DEMO_PROMPTS[0], DEMO_PROMPTS[2]]
    records = run(target, prompts, method=["target-only", "chain", "chain-confident:12"], draft=draft, k=k,
                  max_new_tokens=max_new_tokens, dtype=dtype, stop_below=CROSS_STOP_BELOW)
    found = _divergences(target, records.assign(where="local"), records, prompts)
    table = summarize(records)
    table["identical_to_target_only"] = ~table["method"].isin(found["method"])
    print(table.round(3).to_string(index=False))
    print("\n".join(difference_lines(found, dtype)))
    print("\n".join(speed_verdicts(records)))  # the draft's and the verify's cost in target forwards, measured
    speedups = table.set_index("method")["speedup_vs_target_only"]
    pays = speedups.drop("target-only").max() > 1.0
    print("this row pays: " if pays else "this row did not pay in this run (a loaded machine, or a CPU whose few-row "
          "matmuls cost much more than one row's): ", end="")
    print(f"a draft far smaller than its target is what makes SD pay on a CPU, and {CROSS_TARGET}'s family has no "
          f"model that small. chain-confident ends each chain after a token the draft gave less than "
          f"{CROSS_STOP_BELOW:g}, so it drafts long only where the draft is sure "
          f"({speedups['chain-confident']:.2f}x target-only here, the fixed K={k} chain {speedups['chain']:.2f}x).")
    return records


def _divergences(target, records: pd.DataFrame, reference: pd.DataFrame, prompts: list[str]) -> pd.DataFrame:
    """Each output that left target-only's (`reference`'s): where, method, prompt, and whether the target's
    logits nearly tie there (`api.divergences`). `records` has a `where` column: local, remote, ..."""
    return pd.concat([divergences(records[records["where"] == where], target, prompts, reference=reference)
                      .assign(where=where) for where in records["where"].unique()], ignore_index=True)


def _table(records: pd.DataFrame, found: pd.DataFrame) -> pd.DataFrame:
    """The summary per place and method, with whether every output equals local target-only's (no divergence)."""
    table = summarize(records, by=["where", "method"])
    differ = set(zip(found["where"], found["method"]))
    table["identical_to_target_only"] = [(where, method) not in differ
                                         for where, method in zip(table["where"], table["method"])]
    return table


def _write_report(path, local, dtype: str, rtt_ms: float):
    """Every cached pair as a section; SmolLM2's section gets this run's measured points overlaid."""
    from specbench.hardware import device_name
    from specbench.plan.explore import measured_points, pair_predictions
    from specbench.plan.library import load_profiles, load_references
    from specbench.types import SpecbenchError
    from specbench.viz.report import write_pareto_report

    try:
        sections = pair_predictions(load_profiles(), load_references(), rtts_ms=(rtt_ms,))
    except SpecbenchError:
        return None
    for section in sections:
        target = section["target"]
        if target.model == "smollm2-135m" and target.device == device_name("cpu") and target.dtype == dtype:
            measured = measured_points(local[local["method"].isin(["target-only", "self-draft"])])
            # named like the section's points: `model: operating point`
            measured["label"] = [f"{target.model if method == 'target-only' else target.model + '[:26]'}: {label}"
                                 for method, label in zip(measured["method"], measured["label"])]
            section["measured"] = measured
    return write_pareto_report(path, sections, note="Measured diamonds: this demo run (local, greedy).")
