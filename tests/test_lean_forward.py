"""The fast path's own decoder forward: Hugging Face's results in about half the kernels, no extra memory."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specbench.decode import lean_forward
from specbench.decode.fast_forward import FastForward
from specbench.decode.static_kv import WIDTH_STEP

from conftest import PROMPTS

# ops that only re-view a tensor: no kernel runs for them
VIEWS = {"view", "_unsafe_view", "transpose", "slice", "unsqueeze", "expand", "t", "split", "split_with_sizes",
         "select", "as_strided", "detach", "alias", "permute", "squeeze", "reshape", "_reshape_alias", "unbind"}


class _OpCounter(TorchDispatchMode):
    """Counts the ops that reach a kernel (what a captured graph launches on a GPU, one each)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def tiny_qwen2(seed: int = 0):
    """A tiny Qwen2: biased q/k/v projections, tied embeddings, GQA (4 heads, 2 key/value heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random biases (the init zeroes them), so a wrong fusing of them shows
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                linear.bias.normal_(0, 0.5)
    return model


def tiny_of(kind: str, seed: int = 0):
    """A tiny Mistral (no sliding window) or Qwen3 (per-head q/k norms, given random weights so they count)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
    torch.manual_seed(seed)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=None)).eval()
    model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.3)
            layer.self_attn.k_norm.weight.normal_(1, 0.3)
    return model


def _steps(model, lean: bool):
    """Logits of a lone 5-token step and of a batch of 3 rows (ragged pasts), over static caches."""
    forward = FastForward(model, 2 * WIDTH_STEP, "static", lean=lean)
    assert (forward.lean is not None) == lean
    prompt = (PROMPTS[0] * 30)[:150]
    cache = forward.new_cache()
    forward(cache, prompt[:140], logits_to_keep=1)
    lone = forward(cache, prompt[140:145])
    caches = [forward.new_cache() for _ in range(3)]
    for r, row_cache in enumerate(caches):
        forward(row_cache, prompt[:20 + 7 * r])
    masks = []
    for r in range(3):
        mask = torch.zeros(4, 20 + 7 * r + 4)
        mask[:, -4:] = torch.full((4, 4), torch.finfo(torch.float32).min).triu(1)
        masks.append(mask)
    batch = forward.batch(caches, [prompt[60:64]] * 3, [list(range(20 + 7 * r, 24 + 7 * r)) for r in range(3)], masks)
    return lone, batch


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_lean_steps_equal_hugging_face_steps(tiny_target, kind):
    models = {"llama": lambda: tiny_target.model, "qwen2": tiny_qwen2}
    model = models.get(kind, lambda: tiny_of(kind))()
    assert lean_forward.supports(model)
    hf_lone, hf_batch = _steps(model, lean=False)
    lean_lone, lean_batch = _steps(model, lean=True)
    torch.testing.assert_close(lean_lone, hf_lone, rtol=1e-4, atol=1e-4)
    for got, expected in zip(lean_batch, hf_batch):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_fusing_adds_no_memory_and_leaves_hugging_face_forward_as_it_was():
    model = tiny_qwen2(seed=3)
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    parameters = sum(p.numel() for p in model.parameters())
    first = lean_forward.LeanForward(model)
    again = lean_forward.LeanForward(model)  # a second fast path on the same model: the same fused tensors
    attention = model.model.layers[0].self_attn
    fused = first.layers[0].qkv
    assert again.layers[0].qkv is fused and attention.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attention.v_proj.bias.data_ptr() == first.layers[0].qkv_bias[-attention.v_proj.bias.numel():].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == parameters
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_a_lean_layer_runs_under_half_the_kernels():
    """Kernels per decoder layer (the difference between a 2- and a 6-layer model's step, so the embedding,
    rotary tables and head do not count): Hugging Face's ~40 against the lean forward's ~20."""
    from specbench.models.tiny import tiny_model

    per_layer = {}
    for lean in (False, True):
        counts = []
        for layers in (2, 6):
            forward = FastForward(tiny_model(num_layers=layers).model, WIDTH_STEP, "static", lean=lean)
            cache = forward.new_cache()
            forward(cache, PROMPTS[0])
            with _OpCounter() as counter:
                forward(cache, [3, 4, 5, 6, 7])
            counts.append(sum(counter.ops.values()))
        per_layer[lean] = (counts[1] - counts[0]) / 4
    assert per_layer[True] <= 0.5 * per_layer[False], per_layer


def test_models_it_does_not_compute_exactly_keep_hugging_face_forward(tiny_target):
    from test_kv_pool import tiny_gemma

    assert not lean_forward.supports(tiny_gemma(0).model)  # sliding windows, another norm, another MLP
    forward = FastForward(tiny_target.model, WIDTH_STEP, "static", lean=False)
    assert forward.lean is None
    quantized = tiny_qwen2()
    quantized.hf_quantizer = object()
    assert not lean_forward.supports(quantized)


def test_bfloat16_lean_tokens_leave_eager_ones_only_at_near_ties():
    """In bf16 the lean step rounds differently from Hugging Face's eager forward (one rounding in the fused
    RMSNorm and residual matmuls, fixed shapes): SmolLM2's greedy tokens through it may leave eager's only
    where eager's own logits nearly tie (within 2% of their range) at the first differing position."""
    from specbench.api import outputs, run
    from specbench.decode.divergence import divergence
    from specbench.decode.target import LocalTarget
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    loaded = load_model(ModelSpec("smollm2-135m", dtype="bfloat16"))
    prompts = [loaded.tokenizer.encode(text) for text in
               ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n", "The three laws of motion are")]
    eager = outputs(run(LocalTarget(loaded, kv_pool=False, fast=False), prompts, method="target-only",
                        max_new_tokens=32, progress=False, fast=False))
    target = LocalTarget(loaded, fast="static")
    lean = outputs(run(target, prompts, method="target-only", max_new_tokens=32, progress=False, fast="static"))
    assert target.fast.lean is not None
    for index, prompt in enumerate(prompts):
        expected, got = eager[("target-only", index)], lean[("target-only", index)]
        found = divergence(loaded.model, prompt, expected, got)  # eager's logits where lean's tokens leave it
        if found is not None:
            print(f"prompt {index}: first difference at token {found.position}, eager logit gap "
                  f"{found.share_of_range:.4f} of the range")
            assert found.near_tie, (index, found)
