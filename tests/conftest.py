"""Shared fixtures: tiny random fp32 models (exact, offline) and the embedded SmolLM2 (cached download)."""
import os

import pytest
import torch

from specbench.data_paths import cache_root
from specbench.models.tiny import tiny_model

# torch.compile's generated code kept in the user cache (models live there too): the compiled-backend tests spend
# ~60-75 s of a cold 2-core box generating code that a warm cache replays in ~10 s. It is found again only from the
# same checkout path: inductor's key holds the compiler's command line, whose include paths name this environment's
# torch (a clone elsewhere generated all 123 files again). The graphs are still traced and guarded each run, and the
# tests still compare their tokens with eager ones. One folder per torch version and CPU instruction set: CI's CPU
# model changes between runs, and code generated for AVX-512 must never be replayed on a CPU without it.
_COMPILED = f"{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}".replace("+", "-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor" / _COMPILED))

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """A noisy copy of the target: greedy acceptance around 40%, so both outcomes occur often."""
    return tiny_model(seed=1, noise_from=tiny_target, noise_scale=0.005)


@pytest.fixture(scope="session")
def smollm2():
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    return load_model(ModelSpec("smollm2-135m", dtype="float32"))


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 9, 10, 11], [40, 41, 42, 43, 44, 40, 41, 42],
           [5, 80, 3, 17, 23, 5, 80]]


def assert_batches_match_lone_verifies(batched, alone, prompts, drafters, steps: int, k=3) -> None:
    """Sessions verified through `verify_batch` on `batched` get, step by step, exactly the verdicts and
    committed tokens a lone verify on `alone` gives them (a None drafter sends empty trees). `k`: one draft
    length for every session, or one per session (verifies of several widths in one batch)."""
    import torch

    from specbench.decode.batch import VerifyRequest, verify_batch
    from specbench.types import DraftTree, SamplingParams

    for i, prompt in enumerate(prompts):
        batched.prefill(f"s{i}", prompt)
        alone.prefill(f"s{i}", prompt)
    generator = torch.Generator().manual_seed(0)
    lengths = [k] * len(drafters) if isinstance(k, int) else list(k)
    for step in range(steps):
        requests = [VerifyRequest(f"s{i}", DraftTree() if d is None else
                                  d.propose(batched.committed(f"s{i}"), lengths[i], SamplingParams(), generator),
                                  SamplingParams(), step) for i, d in enumerate(drafters)]
        for request, verdict in zip(requests, verify_batch(batched, requests)):
            lone = alone.verify(request.session, request.tree, request.sampling, request.seed)
            assert (verdict.accepted_path, verdict.bonus_token) == (lone.accepted_path, lone.bonus_token)
            assert batched.committed(request.session) == alone.committed(request.session)


# The files that take longest under `make test` (seconds of test time on a 2-core AVX2 box, 2026-12-02: 243 to 50 s;
# test_sweep.py left it when its Ray tests became `serial`: the rest take 17 s),
# sent to the xdist workers first: with `--dist loadfile` a long file left to the end runs while the others idle.
LONGEST_FIRST = ("tests/test_heads.py", "tests/test_gpu_check.py", "tests/test_serve.py", "tests/test_fast_forward.py",
                 "tests/test_distributions.py", "tests/test_browser.py", "notebooks/05_profile_and_reference.ipynb",
                 "tests/test_golden_greedy.py", "tests/test_suffix.py",
                 "tests/test_real_model.py", "tests/test_tune.py", "notebooks/02_remote_target.ipynb",
                 "tests/test_worker_integrity.py", "tests/test_cross_tokenizer.py", "tests/test_explorer.py",
                 "tests/test_worker.py", "tests/test_prediction.py")


def pytest_collection_modifyitems(session, config, items):
    """Order whole files longest first (a stable sort: each file's own order is kept)."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    root = str(config.rootpath) + "/"

    def key(item):
        return rank.get(str(item.path).removeprefix(root), len(LONGEST_FIRST))

    items.sort(key=key)
