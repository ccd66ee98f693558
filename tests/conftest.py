"""Shared fixtures: tiny random fp32 models (exact, offline) and the embedded SmolLM2 (cached download)."""
import pytest
import torch

from specbench.models.tiny import tiny_model

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
