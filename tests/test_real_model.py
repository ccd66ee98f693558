"""SmolLM2-135M (the embedded CI-sized real model): quantized substitute drafts, chat prompts, refusals."""
import sys

import pytest

from specbench.api import outputs, run
from specbench.models import loading
from specbench.models.loading import ModelTooLargeError, QuantizationUnavailableError, load_model
from specbench.models.spec import ModelSpec

pytestmark = pytest.mark.real_model
PROMPTS = ["Write a haiku about the sea.", "def fibonacci(n):"]


def test_8bit_substitute_of_itself_is_lossless(smollm2):
    records = run(smollm2, PROMPTS, method=["target-only", "substitute"], substitute_quantization="8bit",
                  k=3, max_new_tokens=16, progress=False)
    produced = outputs(records)
    for index in range(len(PROMPTS)):
        assert produced[("substitute", index)] == produced[("target-only", index)]
    substitute = records[records.method == "substitute"]
    assert substitute["accepted"].sum() / substitute["drafted"].sum() > 0.5  # a quantized twin agrees often


def test_chat_template_is_applied(smollm2):
    from specbench.api import encode_prompts

    ids = encode_prompts(["hi"], smollm2.tokenizer)[0]
    assert "<|im_start|>assistant" in smollm2.tokenizer.decode(ids)


def test_missing_bitsandbytes_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(QuantizationUnavailableError, match="quantization='none'"):
        load_model(ModelSpec("smollm2-135m", quantization="4bit"))


def test_model_that_will_not_fit_is_refused(monkeypatch, smollm2):
    monkeypatch.setattr(loading, "available_bytes", lambda device: 10 * 2**20)
    with pytest.raises(ModelTooLargeError, match="GiB is free; try quantization"):
        load_model(ModelSpec("smollm2-135m"))
