"""Prediction vs measurement on SmolLM2 self-draft (CI-sized): the error is printed and bounded."""
import pytest

from specbench.api import run
from specbench.decode.metrics import time_split, tokens_per_second, tokens_per_step
from specbench.models.self_draft import truncated_view
from specbench.plan.predict import OperatingPoint, predict
from specbench.record import profile_model, record_reference

pytestmark = pytest.mark.real_model
PROMPTS = ["Write a Python function that returns the squares of a list of numbers.",
           "def is_prime(n):", "Explain what a linked list is in two sentences."]


def test_predicted_chain_matches_a_measured_run(smollm2):
    """Tokens per step replay exactly from the reference (a deterministic count): within 5%. Tokens/s is
    printed, not asserted: it depends on what else the box runs between the profile and the run (3 of 3
    tries were 25-34% off on a loaded box while tokens per step held to 0.3%), so the speed goal lives in
    `benchmarks/fidelity.py`, which calibrates with a target-only run taken in the same window."""
    draft = truncated_view(smollm2, 26)
    reference = record_reference(smollm2, draft, PROMPTS, dataset="ci-prompts", max_chain=3, max_new_tokens=24)
    target_profile, _ = profile_model(smollm2, tokens=(1, 4), contexts=(64,), repeats=3)  # widths K=3 verifies
    draft_profile, _ = profile_model(draft, tokens=(1, 2), contexts=(64,), repeats=3)
    measured = run(smollm2, PROMPTS, method="chain", draft=draft, k=3, max_new_tokens=24, progress=False)
    overhead = time_split(measured)["overhead_s"]
    [row] = predict([OperatingPoint("chain", 3)], target_profile, draft_profile, reference, context=64,
                    overhead_s=overhead)
    step_error = row["tokens_per_step"] / tokens_per_step(measured) - 1
    speed_error = row["tokens_per_s"] / tokens_per_second(measured) - 1
    print(f"\nprediction error: tokens_per_step {step_error:+.1%}, tokens/s {speed_error:+.1%} (not asserted; "
          f"predicted {row['tokens_per_s']:.2f} vs measured {tokens_per_second(measured):.2f} tok/s)")
    assert abs(step_error) <= 0.05
