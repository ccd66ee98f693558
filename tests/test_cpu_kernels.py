"""oneDNN linear layers (`kernels="onednn"`): the same model to float rounding, SD through them still
lossless, the right layers converted, and clear refusals where they cannot run."""
import copy

import pytest
import torch

from specbench.decode.drafters import ModelDrafter
from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.models.cpu_kernels import MIN_WEIGHTS, OneDNNLinear, use_onednn
from specbench.models.loaded import LoadedModel
from specbench.models.spec import ModelSpec, acceptance_label
from specbench.types import SpecbenchError

from conftest import PROMPTS, assert_batches_match_lone_verifies


@pytest.fixture(scope="module")
def onednn_target(tiny_target):
    """The tiny target with every linear layer on oneDNN (the size threshold lowered to 0)."""
    model = copy.deepcopy(tiny_target.model)
    assert use_onednn(model, min_weights=0) == sum(isinstance(m, OneDNNLinear) for m in model.modules()) > 0
    return LoadedModel(spec=tiny_target.spec.with_(kernels="onednn"), model=model, tokenizer=None)


def test_onednn_layers_give_the_same_logits(tiny_target, onednn_target):
    ids = torch.tensor([PROMPTS[0][:7], PROMPTS[1][:7]])
    with torch.inference_mode():
        want, got = tiny_target.model(input_ids=ids).logits, onednn_target.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_sd_through_onednn_layers_is_lossless(tiny_draft, onednn_target):
    """Golden: greedy chain SD on the converted target equals its own target-only greedy, token for
    token, alone and in a packed batch with other sessions."""
    for prompt in PROMPTS[:3]:
        alone = generate(LocalTarget(onednn_target), None, prompt, Decoding(0, 24, kind="none")).output_ids
        sd = generate(LocalTarget(onednn_target), ModelDrafter(tiny_draft, 96), prompt,
                      Decoding(4, 24, kind="chain")).output_ids
        assert sd == alone
    batched, lone = LocalTarget(onednn_target), LocalTarget(onednn_target, kv_pool=False)
    assert batched.packed
    assert_batches_match_lone_verifies(batched, lone, PROMPTS[:3], [ModelDrafter(tiny_draft, 96)] * 3, steps=6,
                                       k=(1, 2, 3))


def test_only_large_layers_are_converted(smollm2):
    """SmolLM2's layers are all under the threshold but its tied 49152 x 576 head: that one is
    converted, into a copy of its own (the embedding keeps the plain one), and the bytes say so."""
    from specbench.models.loading import load_model

    fast = load_model(smollm2.spec.with_(kernels="onednn"))
    converted = [name for name, m in fast.model.named_modules() if isinstance(m, OneDNNLinear)]
    assert converted == ["lm_head"] and 576 * 49152 >= MIN_WEIGHTS
    assert fast.weight_bytes == smollm2.weight_bytes + 576 * 49152 * 4
    assert fast.vocab_size == smollm2.vocab_size and fast.spec.label == "smollm2-135m+onednn"
    ids = torch.tensor([PROMPTS[0]]) % 1000 + 100
    with torch.inference_mode():
        torch.testing.assert_close(fast.model(input_ids=ids).logits, smollm2.model(input_ids=ids).logits,
                                   rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("changes, words", [
    ({"dtype": "bfloat16"}, "float32"), ({"quantization": "int8-dynamic"}, "unquantized"),
    ({"device": "cuda"}, "CPU"), ({"kernels": "cublas"}, "unknown kernels")])
def test_onednn_where_it_cannot_run_is_refused_by_name(changes, words):
    from specbench.models.loading import load_model

    with pytest.raises(SpecbenchError, match=words):
        load_model(ModelSpec("tiny-random:seed=0,vocab=96,hidden=64,layers=3", **{"kernels": "onednn", **changes}))


def test_onednn_usable_agrees_with_the_refusals():
    """The demo asks before it loads: a load `onednn_usable` accepts is one `check_onednn` does not refuse."""
    from specbench.models.cpu_kernels import onednn_usable

    assert onednn_usable("cpu", "float32", "none") == torch.backends.mkldnn.is_available()
    assert not onednn_usable("cpu", "bfloat16", "none")
    assert not onednn_usable("cuda", "float32", "none")
    assert not onednn_usable("cpu", "float32", "int8-dynamic")


def test_kernels_change_speed_not_acceptance():
    """A "+onednn" profile pairs with the reference of the plain model (acceptance is the same), a draft
    profiled with the same kernels is preferred, and both kernels of a target sit in one family."""
    from specbench.plan.explore import base_name, matching_pairs
    from specbench.plan.predict import AcceptanceReference, LatencyProfile

    assert acceptance_label("qwen2.5-coder-1.5b@8bit+onednn") == "qwen2.5-coder-1.5b@8bit"
    assert base_name("qwen2.5-coder-1.5b@8bit+onednn") == "qwen2.5-coder-1.5b"  # one family in notebook 03
    row = ((1, 128, 0.1),)
    profiles = [LatencyProfile(name, "cpu", rows=row) for name in ("t", "t+onednn", "d", "d+onednn")]
    reference = AcceptanceReference(draft="d", target="t", dataset="x", rule="greedy", temperature=0.0,
                                    max_chain=2, chain_accepts=(1, 2))
    pairs = {(t.model, d.model) for t, d, _ in matching_pairs(profiles, [reference])}
    assert pairs == {("t", "d"), ("t+onednn", "d+onednn")}


def test_fast_profiles_pair_with_fast_drafts_in_views_of_their_own():
    """A GPU's eager and fast-cudagraph profiles of one pair: each target takes the draft profiled with its
    own forward, and the two forwards are separate Pareto views (one would hide the other)."""
    from specbench.plan.explore import matching_pairs, target_groups
    from specbench.plan.predict import AcceptanceReference, LatencyProfile

    profiles = [LatencyProfile(name, "gpu", rows=((1, 128, seconds),), forward=forward)
                for name, forward, seconds in (("t", "eager", 0.04), ("t", "fast-cudagraph", 0.005),
                                               ("d", "eager", 0.04), ("d", "fast-cudagraph", 0.003))]
    reference = AcceptanceReference(draft="d", target="t", dataset="x", rule="greedy", temperature=0.0,
                                    max_chain=2, chain_accepts=(1, 2))
    pairs = {(t.forward, d.forward) for t, d, _ in matching_pairs(profiles, [reference])}
    assert pairs == {("eager", "eager"), ("fast-cudagraph", "fast-cudagraph")}
    groups = target_groups(matching_pairs(profiles, [reference]))
    assert sorted(groups) == ["t (gpu, float32, fast-cudagraph, x)", "t (gpu, float32, x)"]
