"""The GPU issue's checks, in its priority order, as one run that fits a short lease (`gpu_check.sh` starts it).

Each part runs as its own process with a time limit, inside one overall budget (`--budget`, default 450 s, so
that a rerun still fits a 15-minute lease); a part that does not fit what is left is skipped and said so.
On CUDA: (1) tests/test_cuda.py, (2) the 1.5B architecture's verify step, lean vs Hugging Face's step vs the
memory floor, with the lean step's kernels, (3) chain SD under load on a worker, measured vs predicted,
target-only under the same load, (4) fast and eager profiles of the Qwen2.5 0.5B / 1.5B / 7B architectures
(batch rows 1/2/4/8), (5) `specbench serve`, draft heads and suffix decoding on the device against the CPU.
Without CUDA every part runs in a small CPU form (the tiny architectures), which checks the script end to end;
the CUDA measurements are skipped and the table says so.
Writes gpu_check.md (the tables), gpu_check.json, gpu_check.log and profiles.tar.gz (when profiles were
written) under `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parts(cuda: bool, out: Path, work: Path) -> list[dict]:
    """(name, what it checks, command, time limit in s, JSON it writes) in the issue's priority order."""
    py = [sys.executable]
    if cuda:
        step = ["--archs", "qwen2.5-1.5b", "--tokens", "1", "4", "8", "--contexts", "512", "--batches", "1",
                "--step-tokens", "1", "4", "8", "--prompts", "100", "512", "--repeats", "20", "--kernels",
                "--sdpa", "math", "efficient_attention", "cudnn_attention"]
        load = ["--arch", "qwen2.5-1.5b", "--clients", "1", "2", "4", "8", "--max-new-tokens", "64", "--rounds", "2",
                "--prompt-tokens", "100"]
        compiled = ["--archs", "qwen2.5-1.5b", "--backend", "compiled-graph", "--tokens", "1", "--contexts", "512",
                    "--batches", "1", "--step-tokens", "1", "8", "--lean-only", "--prompts", "100", "--repeats", "20"]
        grid = ["--archs", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "--tokens", "1", "2", "3", "4", "5", "6",
                "8", "12", "16", "24", "32", "--contexts", "128", "512", "2048", "--batches", "2", "4", "8",
                "--batch-tokens", "1", "2", "4", "5", "8", "--batch-contexts", "512", "--step-tokens", "1",
                "--prompts", "512", "--repeats", "5"]
    else:  # the same scripts on the tiny architectures: a rehearsal of this run, not a measurement
        tiny = ["--device", "cpu", "--dtype", "float32", "--backend", "static", "--repeats", "2"]
        step = ["--archs", "tiny", "--tokens", "1", "4", "--contexts", "32", "--batches", "1", "--step-tokens", "1",
                "4", "--prompts", "32", "--kernels", *tiny]
        load = ["--device", "cpu", "--dtype", "float32", "--arch", "tiny", "--clients", "1", "2",
                "--max-new-tokens", "16", "--rounds", "1", "--prompt-tokens", "16"]
        compiled = ["--archs", "tiny", "--tokens", "1", "--contexts", "32", "--batches", "1", "--step-tokens", "1",
                    "--lean-only", "--prompts", "32", *tiny]  # compiled-graph is CUDA's: static stands in for it
        grid = ["--archs", "tiny-draft", "tiny", "--tokens", "1", "2", "--contexts", "32", "--batches", "2",
                "--batch-tokens", "1", "--batch-contexts", "32", "--step-tokens", "1", "--prompts", "32", *tiny]
    pytest = py + ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", "--durations=5",
                   str(ROOT / "tests" / "test_cuda.py")]
    return [
        {"name": "cuda-tests", "what": "tests/test_cuda.py on the device, all but the compiled backends",
         "command": pytest + ["-k", "not compile"], "limit": 150, "json": None},
        {"name": "step", "what": "1.5B verify step: lean vs Hugging Face's vs the memory floor, and its kernels",
         "command": py + [str(HERE / "gpu.py"), *step, "--no-pairs", "--out", str(out / "step.json")],
         "limit": 120, "json": out / "step.json"},
        {"name": "worker-load", "what": "chain SD on a shared worker at 1/2/4/8 clients: measured vs predicted",
         "command": py + [str(HERE / "gpu_worker.py"), "--chain", *load, "--out", str(out / "worker.json")],
         "limit": 180, "json": out / "worker.json"},
        {"name": "worker-load-target-only", "what": "target-only on a shared worker at 1/2/4/8 clients: measured vs "
         "predicted (no drafting hides the worker's time)",
         "command": py + [str(HERE / "gpu_worker.py"), "--chain", "--k", "0", "--draft-ms", "0", *load, "--out",
                          str(out / "worker-target-only.json")],
         "limit": 150, "json": out / "worker-target-only.json"},
        {"name": "profiles", "what": "eager and fast profiles of the Qwen2.5 0.5B/1.5B/7B architectures, rows 1-8",
         "command": py + [str(HERE / "gpu.py"), *grid, "--no-pairs", "--save-profiles", "--profiles-dir",
                          str(work / "profiles"), "--out", str(out / "profiles.json")],
         "limit": 200, "json": out / "profiles.json"},
        {"name": "serve", "what": "`specbench serve` on the device vs the CPU, fp32 greedy",
         "command": py + [str(HERE / "gpu_serve.py"), "--out", str(out / "serve.json")], "limit": 90,
         "json": out / "serve.json"},
        {"name": "heads", "what": "draft heads (eagle, eagle-tree) and suffix decoding on the device vs the CPU, fp32",
         "command": py + [str(HERE / "gpu_heads.py"), "--out", str(out / "heads.json")], "limit": 90,
         "json": out / "heads.json"},
        {"name": "step-compiled", "what": "the 1.5B lean verify step compiled, then captured (`compiled-graph`: "
         "fused elementwise kernels) vs the memory floor",
         "command": py + [str(HERE / "gpu.py"), *compiled, "--no-pairs", "--out", str(out / "step-compiled.json")],
         "limit": 240, "json": out / "step-compiled.json"},
        {"name": "cuda-tests-compiled", "what": "tests/test_cuda.py's compiled backends (compile, compiled-graph)",
         "command": pytest + ["-k", "compile"], "limit": 150, "json": None},
    ]


def failed_tests(result: dict) -> list[str]:
    """Test ids pytest reported as failed or erroring (its -v lines), to rerun with the lean step off."""
    return sorted({line.split()[1] for line in result.get("output", "").splitlines()
                   if line.startswith(("FAILED ", "ERROR ")) and "::" in line})


def run_part(part: dict, limit: float, log, env: dict | None = None) -> dict:
    started = time.perf_counter()
    log.write(f"\n===== {part['name']}: {' '.join(part['command'])} (limit {limit:.0f} s)\n")
    log.flush()
    process = subprocess.Popen(part["command"], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ, **(env or {})), start_new_session=True)
    try:
        output = process.communicate(timeout=limit)[0]
        status = "ok" if process.returncode == 0 else f"failed (exit {process.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the part's workers and clients with it: the GPU is freed
        output, status = process.communicate()[0], f"timed out after {limit:.0f} s"
    log.write(output)
    log.flush()
    lines = output.strip().splitlines()
    verdicts = [line for line in lines if any(f" {word}" in line for word in ("PASSED", "FAILED", "ERROR", "SKIPPED"))]
    tail = list(dict.fromkeys(verdicts + lines[-6:])) if part["name"].startswith("cuda-tests") else lines[-12:]
    result = {"name": part["name"], "what": part["what"], "status": status,
              "seconds": round(time.perf_counter() - started, 1), "tail": tail, "output": output}
    if part["json"] is not None and Path(part["json"]).exists():
        result["report"] = json.loads(Path(part["json"]).read_text())
    return result


def table(rows: list[dict], columns: list[str], digits: int = 3) -> list[str]:
    def cell(value):
        return f"{value:.{digits}f}" if isinstance(value, float) else "" if value is None else str(value)

    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]


def summary(result: dict, cuda: bool) -> list[str]:
    """The part's figures in markdown: what the closing note and the results page quote."""
    lines = [f"## {result['name']}: {result['what']}", "",
             f"{result['status']}, {result['seconds']} s"
             + ("" if cuda else " (CPU rehearsal: CUDA measurement skipped)"),
             ""]
    report = result.get("report") or {}
    if result["name"].startswith("cuda-tests"):
        lines += ["```", *[line for line in result["tail"] if line.strip()], "```"]
    elif result["name"] in ("step", "step-compiled") and report:
        held = sorted({key for row in report.get("steps", []) for key in row  # attention held to a kernel (--sdpa)
                       if key.startswith("lean_") and key.endswith("_ms") and key != "lean_ms"})
        lines += table(report.get("steps", []), ["arch", "tokens", "context", "backend", "lean_ms", "hf_step_ms",
                                                 *held, "floor_ms", "lean_over_floor"])
        met = [row["lean_over_floor"] <= 2.0 for row in report.get("steps", [])]
        lines += ["", f"goal (lean step within 2x of the floor): {'met' if met and all(met) else 'not met'}", ""]
        lines += table(report.get("forwards", []), ["arch", "tokens", "context", "eager_ms", "fast_ms", "floor_ms"])
        if report.get("kernels"):
            lines += ["", "lean step kernels, per forward:", ""]
            lines += table(report["kernels"], ["kernel", "per_forward", "per_layer", "us_per_forward", "share"], 2)
        if report.get("prefills"):
            lines += [""] + table(report["prefills"], ["arch", "prompt", "eager_ms", "fast_ms", "chunks_replayed"])
    elif result["name"].startswith("worker-load") and report:
        lines += table(report["rows"], ["clients", "measured_tok_s", "predicted_tok_s", "error",
                                        "predicted_without_host_tok_s", "error_without_host", "misses", "lossless"])
        host = report.get("host", {})
        met = [abs(row["error"]) <= 0.15 for row in report["rows"]]
        lines += ["", f"host work per round: {1000 * host.get('fixed_s', 0):.3f} ms + "
                  f"{1000 * host.get('row_s', 0):.3f} ms per row; loopback {report.get('network_ms', 0):.2f} ms; "
                  f"{report.get('accepted_per_step', 0):.2f} accepted per step alone",
                  f"goal (predicted within 15% at every client count): {'met' if met and all(met) else 'not met'}"]
    elif result["name"] == "profiles" and report:
        fast = [r for r in report.get("forwards", []) if r["tokens"] in (1, 5) and r["context"] == 512]
        lines += table(fast, ["arch", "batch", "tokens", "context", "eager_ms", "fast_ms", "floor_ms"])
    elif result["name"] == "serve" and report:
        lines += [f"identical to the CPU's: {report['identical']} of {report['completions']}; identical to "
                  f"target-only's: {report['agree_with_target_only']}"]
    elif result["name"] == "heads" and report:
        lines += [f"identical to the CPU's: {report['identical']} of {report['outputs']}; identical to "
                  f"target-only's: {report['agree_with_target_only']}; accepted per step: "
                  f"{report['accepted_per_step']}"]
    if result["status"] != "ok":
        lines += ["", "last lines:", "```", *result["tail"], "```"]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=500.0, help="seconds for all parts together")
    parser.add_argument("--only", nargs="+", default=None, help="run only these parts (a rerun)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = out.parent / f".{out.name}-work"
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "no CUDA device (CPU rehearsal)"
    deadline, results = time.perf_counter() + args.budget, []
    header = [f"# GPU check: {device}", "",
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; torch {torch.__version__}; "
              f"`bash benchmarks/gpu_check.sh` (budget {args.budget:.0f} s)", ""]
    with open(out / "gpu_check.log", "w") as log:
        for part in parts(cuda, out, work):
            if args.only and part["name"] not in args.only:
                continue
            left = deadline - time.perf_counter()
            if left < min(30.0, part["limit"]):
                results.append({"name": part["name"], "what": part["what"], "seconds": 0, "tail": [],
                                "status": f"skipped: {left:.0f} s of the budget left"})
            else:
                results.append(run_part(part, min(part["limit"], left), log))
            print(f"{results[-1]['name']}: {results[-1]['status']} ({results[-1]['seconds']} s)", flush=True)
            failed = failed_tests(results[-1]) if part["name"].startswith("cuda-tests") else []
            if failed and deadline - time.perf_counter() > 60:  # bisect: the same tests with Hugging Face's step
                rerun = dict(part, name=part["name"] + "-lean-off", what="the failures again, SPECBENCH_LEAN_STEP=0",
                             command=part["command"][:part["command"].index(str(ROOT / "tests" / "test_cuda.py"))]
                             + [test if "/" in test else str(ROOT / test) for test in failed])
                results.append(run_part(rerun, min(90.0, deadline - time.perf_counter()), log,
                                        env={"SPECBENCH_LEAN_STEP": "0"}))
                print(f"{results[-1]['name']}: {results[-1]['status']}", flush=True)
    if (work / "profiles").exists():
        with tarfile.open(out / "profiles.tar.gz", "w:gz") as archive:
            archive.add(work / "profiles", arcname="profiles")
    lines = header + [line for result in results for line in summary(result, cuda)]
    (out / "gpu_check.md").write_text("\n".join(lines))
    for result in results:
        result.pop("output", None)  # kept whole in gpu_check.log
    (out / "gpu_check.json").write_text(json.dumps({"device": device, "cuda": cuda, "parts": results}, indent=1,
                                                   default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
