"""SmolLM2-135M (the embedded CI-sized real model): quantized substitute drafts, chat prompts, refusals."""
import sys

import pytest

from specbench.api import outputs, run
from specbench.models import loading
from specbench.models.loading import ModelTooLargeError, QuantizationUnavailableError, load_model
from specbench.models.spec import ModelSpec

pytestmark = pytest.mark.real_model
PROMPTS = ["Write a haiku about the sea.", "def fibonacci(n):"]


@pytest.mark.parametrize("quantization, agreement", [("8bit", 0.5), ("4bit", 0.1), ("int8-dynamic", 0.3)])
def test_quantized_substitute_of_itself_is_lossless(smollm2, quantization, agreement):
    records = run(smollm2, PROMPTS, method=["target-only", "substitute"], substitute_quantization=quantization,
                  k=3, max_new_tokens=16, progress=False, warmup=False)
    produced = outputs(records)
    for index in range(len(PROMPTS)):
        assert produced[("substitute", index)] == produced[("target-only", index)]
    substitute = records[records.method == "substitute"]
    # records carry both models' weights as loaded: the twin is the smaller
    assert (substitute["draft_weight_bytes"] < 0.6 * substitute["target_weight_bytes"]).all()
    # a quantized twin agrees often (seen here: 8bit 0.6+, int8-dynamic 0.47, 4bit lower)
    assert substitute["accepted"].sum() / substitute["drafted"].sum() > agreement


def test_a_bf16_targets_int8_dynamic_substitute_quantizes_float32_weights():
    """PyTorch's dynamic int8 quantizes float32 Linear layers only: a bf16 target's substitute loads the same
    weights in float32 and quantizes those (it was refused, naming the dtype); greedy output stays the target's."""
    records = run("tiny-random:seed=0,layers=4", [[5, 9, 14, 3, 7]], method=["target-only", "substitute"],
                  substitute_quantization="int8-dynamic", dtype="bfloat16", k=3, max_new_tokens=12, progress=False)
    produced = outputs(records)
    assert produced[("substitute", 0)] == produced[("target-only", 0)]
    assert records.loc[records.method == "substitute", "drafted"].sum() > 0
    bf16 = ModelSpec("smollm2-135m", dtype="bfloat16")  # the one rule `run`'s substitute and a tune's candidate share
    assert bf16.quantized("int8-dynamic").dtype == "float32" and bf16.quantized("8bit").dtype == "bfloat16"


@pytest.mark.parametrize("quantization, at_most", [("8bit", 0.5), ("4bit", 0.4), ("int8-dynamic", 0.55)])
def test_quantized_weights_are_measured_smaller(smollm2, quantization, at_most):
    quantized = load_model(ModelSpec("smollm2-135m", quantization=quantization))
    assert smollm2.weight_bytes > 500 * 2**20  # fp32, the tied embedding counted once
    assert quantized.weight_bytes < at_most * smollm2.weight_bytes
    assert quantized.vocab_size == smollm2.vocab_size
    # 30 layers x (K, V) x 3 KV heads x 64 x 4 bytes: the cache stays in the compute dtype
    assert quantized.kv_bytes_per_token == smollm2.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4


def test_int8_dynamic_where_it_cannot_run_is_refused_with_what_would():
    with pytest.raises(QuantizationUnavailableError, match="CPU only.*use quantization='8bit' or '4bit'"):
        load_model(ModelSpec("smollm2-135m", quantization="int8-dynamic", device="cuda"))
    with pytest.raises(QuantizationUnavailableError, match="dtype='float32'"):
        load_model(ModelSpec("smollm2-135m", quantization="int8-dynamic", dtype="bfloat16"))


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
