"""Device-correct timing and device-resident verification, exercised on CPU through the GPU's code path."""
import torch

from specbench.decode import clock
from specbench.decode.target import LocalTarget
from specbench.sampling import verify as verify_module
from specbench.sampling.verify import verify
from specbench.types import DraftTree, SamplingParams


def test_every_timed_span_of_a_verify_waits_for_the_target_device(tiny_target, monkeypatch):
    """The verify reads the clock only through device_time(target device): on CUDA each read waits for
    the forward to finish, so target_forward_s is the forward's run, not its launch."""
    waited = []
    monkeypatch.setattr(clock, "synchronize", lambda device: waited.append(torch.device(device)))
    target = LocalTarget(tiny_target)
    target.prefill("s", [1, 2, 3, 4])
    assert waited == [torch.device("cpu")]  # the prefill ends waiting for its forward
    waited.clear()
    verdict = target.verify("s", DraftTree(tokens=(5, 6), parents=(-1, 0)), SamplingParams(), seed=0)
    assert waited == [torch.device("cpu")] * 4  # verify start, forward start, forward end, verify end
    assert 0 < verdict.timing.target_forward_s <= verdict.timing.verify_s


def test_synchronize_waits_on_cuda_devices_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock.synchronize("cpu")
    clock.synchronize(torch.device("cpu"))
    assert calls == []
    clock.synchronize(torch.device("cuda", 1))  # the stub stands in for a GPU this machine lacks
    assert calls == [torch.device("cuda", 1)]


def test_verification_reads_logits_in_their_own_dtype_without_copying_them_whole(monkeypatch):
    """Greedy verification takes the argmax where the logits are (bf16 here, as a GPU target's would be)
    and gives what float32 logits give; sampled rules process only the rows they visit."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator) * 4
    tree = DraftTree(tokens=tuple(int(t) for t in logits[:3].argmax(-1)), parents=(-1, 0, 1))
    rounded = logits.bfloat16()
    assert verify(tree, rounded, SamplingParams(), generator) == verify(tree, rounded.float(), SamplingParams(),
                                                                      generator)
    visited = []
    original = verify_module.processed_probs
    monkeypatch.setattr(verify_module, "processed_probs",
                        lambda rows, sampling: visited.append(len(rows)) or original(rows, sampling))
    sampled = SamplingParams(temperature=1.0, rule="sample-match")
    chain = DraftTree(tokens=(int(logits[0].argmin()), 1, 2), parents=(-1, 0, 1))  # rejected at the root
    path, _ = verify(chain, logits, sampled, torch.Generator().manual_seed(1))
    assert path == () and visited == [1]  # one row of four processed


def test_peak_device_memory_is_recorded_per_prompt_where_the_device_reports_it(tiny_target, monkeypatch):
    """Issue 14: a run's peak memory where the device reports it. CUDA's counters (stubbed: no GPU here)
    are reset before each prompt and read after it; on a CPU the column is empty, not a made-up figure."""
    import specbench.api as api
    from specbench import hardware
    from specbench.api import run

    events = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: events.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 12345)
    hardware.reset_peak_memory("cuda:1")
    assert hardware.peak_memory_bytes("cuda:1") == 12345 and events == [("reset", torch.device("cuda", 1))]
    assert hardware.peak_memory_bytes("cpu") is None and hardware.peak_memory_bytes(None) is None

    records = run(tiny_target, [[1, 2, 3], [4, 5, 6]], method="target-only", max_new_tokens=3, progress=False,
                  warmup=False)
    assert records["device_peak_bytes"].isna().all()
    windows = []  # on a device that reports it: one window per prompt, its own figure on its rows
    monkeypatch.setattr(api, "reset_peak_memory", lambda device: windows.append(device))
    monkeypatch.setattr(api, "peak_memory_bytes", lambda device: 1000 * len(windows))
    records = run(tiny_target, [[1, 2, 3], [4, 5, 6]], method="target-only", max_new_tokens=3, progress=False,
                  warmup=False)
    assert windows == ["cpu", "cpu"]
    assert records.groupby("prompt_index")["device_peak_bytes"].first().tolist() == [1000, 2000]


def test_cpu_names_carry_the_vector_extensions():
    """Two VMs with one model name but different matmul speed get different profile names; a CPU without
    AVX-512 keeps the name profiles were recorded under before the suffix existed."""
    from specbench.hardware import cpu_name

    info = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 {}\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\nflags\t: fpu\n"
    assert cpu_name(info.format(""), 2) == "cpu-2t-AMD-EPYC"
    assert cpu_name(info.format("avx512f avx512bw"), 2) == "cpu-2t-AMD-EPYC-avx512"
    assert cpu_name(info.format("avx512f avx512_bf16"), 2) == "cpu-2t-AMD-EPYC-avx512bf16"
    assert cpu_name(info.format("avx512f avx512_bf16 amx_tile amx_bf16"), 2) == "cpu-2t-AMD-EPYC-amx"
    assert cpu_name("", 4).startswith("cpu-4t-")
