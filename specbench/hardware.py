"""What machine this is and how many watts it draws: names and power sources for profiles."""
from __future__ import annotations

import platform
import re
import time
from pathlib import Path
from typing import Optional

import torch


def device_name(device: str = "cpu") -> str:
    """The name profiles are filed under. CPUs: threads, model name, and the vector extensions that change
    matmul speed by 2-5x (two VMs both called "AMD EPYC" differ by AVX-512 and native bf16)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device)).replace(" ", "-")
    try:
        with open("/proc/cpuinfo") as info:
            return cpu_name(info.read(), torch.get_num_threads())
    except OSError:
        pass
    return f"cpu-{torch.get_num_threads()}t-{platform.machine()}"


def machine_label(device: str = "cpu") -> str:
    """What a measurement was taken on, as a tune files it: this machine (the loop, the drafts) and, when another,
    the device a target here runs on (`cpu-2t-AMD-EPYC-avx512bf16 + NVIDIA-H100-80GB-HBM3`)."""
    return _with_this_machine(device_name(device))


def _with_this_machine(there: str) -> str:
    here = device_name("cpu")
    return here if there == here else f"{here} + {there}"


def on_worker(runner) -> bool:
    """Whether `runner` is a target in a worker (`RemoteTarget`), not a model here."""
    return bool(getattr(runner, "endpoint", None)) and isinstance(getattr(runner, "info", None), dict)


def target_device(runner) -> str:
    """The name of the device a target runs on: a worker's, as it reports it, or its model's here."""
    if on_worker(runner):
        return runner.info.get("device_name") or runner.info.get("device") or "worker"
    return device_name(str(runner.model.get_input_embeddings().weight.device))


def machine_of(runner) -> str:
    """What a measurement through `runner` was taken on: `machine_label` of a model here, or for a worker this
    machine (the loop, the drafts) and the worker's device."""
    if on_worker(runner):
        return f"{device_name('cpu')} -> worker {target_device(runner)}"
    return _with_this_machine(target_device(runner))


def nearness(device: str, here: str) -> int:
    """How near a profile's `device` is to `here`: 0 the same, 1 the same CPU with another thread count (the same
    cores and vector units, run wider or narrower), 2 another device of the same kind (CPU or GPU), 3 the other kind
    (a GPU's forward costs say little of a CPU's)."""
    if device == here:
        return 0
    threads = re.compile(r"^cpu-\d+t-")
    if threads.match(device) and threads.sub("", device) == threads.sub("", here):
        return 1
    return 2 if device.startswith("cpu-") == here.startswith("cpu-") else 3


def target_of(label: str) -> str:
    """The device the target ran on, in a `machine_label` or `machine_of` label: a worker's, a device beside this
    machine, or (neither named) this machine itself."""
    for mark in (" -> worker ", " + "):
        if mark in label:
            return label.split(mark, 1)[1]
    return label


def cpu_name(cpuinfo: str, threads: int) -> str:
    """`cpu-<threads>t-<model name>`, then `-avx512`, `-avx512bf16` or `-amx` (AMX tiles: bf16 matmuls of many
    rows 3x fp32's, where AVX-512 bf16 gives about 2x) where the first CPU has them (no suffix without AVX-512,
    so names recorded before the suffix existed still match such machines)."""
    name, flags = None, set()
    for line in cpuinfo.splitlines():
        if line.startswith("model name") and name is None:
            name = "-".join(line.split(":", 1)[1].split())[:40]
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    suffix = ("-amx" if "amx_bf16" in flags else "-avx512bf16" if "avx512_bf16" in flags
              else "-avx512" if "avx512f" in flags else "")
    return f"cpu-{threads}t-{name or platform.machine()}{suffix}"


def measure_power(device: str = "cpu", seconds: float = 0.5, configured_watts: Optional[float] = None) -> dict:
    """Watts and where they came from: NVML on a GPU, RAPL on a CPU where readable, else configured."""
    if device.startswith("cuda"):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.device(device).index or 0)
            return {"watts": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000, "source": "nvml"}
        except Exception:
            pass
    rapl = Path("/sys/class/powercap/intel-rapl:0/energy_uj")
    try:
        first = int(rapl.read_text())
        time.sleep(seconds)
        second = int(rapl.read_text())
        return {"watts": (second - first) / 1e6 / seconds, "source": "rapl"}
    except (OSError, ValueError):
        return {"watts": configured_watts, "source": "configured"}


def reset_peak_memory(device: Optional[str]) -> None:
    """Start a new peak-memory window on `device` (CUDA only: a CPU has no per-device counter)."""
    if device is not None and str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def peak_memory_bytes(device: Optional[str]) -> Optional[int]:
    """Most bytes allocated on `device` since the last reset, where the device reports it (CUDA);
    None elsewhere: a process's peak RSS would mix in everything it did before."""
    if device is not None and str(device).startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return None
