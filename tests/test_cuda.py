"""The GPU path on a CUDA device: captured and compiled steps give eager's tokens, batched verifies give lone
verifies' verdicts, sampled SD follows the target, and a worker serves on CUDA. Skipped without CUDA (CI has
none); run on a lent GPU with `python -m pytest tests/test_cuda.py`."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from specbench.api import outputs, run
from specbench.decode.divergence import divergence
from specbench.decode.drafters import ModelDrafter
from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.decode.tree_drafters import TreeDrafter
from specbench.models.tiny import tiny_model
from specbench.types import DraftTree, SamplingParams

from conftest import PROMPTS, assert_batches_match_lone_verifies

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY_METHODS = ["target-only", "chain", "chain-confident", "tree", "prompt-lookup", "self-draft"]


def on_cuda(loaded):
    moved = copy.deepcopy(loaded)
    moved.model.to("cuda")
    moved.spec = dataclasses.replace(moved.spec, device="cuda")
    return moved


@pytest.fixture(scope="module")
def cuda_target(tiny_target):
    return on_cuda(tiny_target)


@pytest.fixture(scope="module")
def cuda_draft(tiny_draft):
    return on_cuda(tiny_draft)


@pytest.mark.parametrize("backend", ["cudagraph", "compiled-graph", "compile", "static"])
def test_fast_steps_on_cuda_equal_eager_greedy(cuda_target, cuda_draft, tiny_target, backend):
    """fp32 greedy through each backend on the GPU: token for token the CPU's eager target-only."""
    prompts = PROMPTS[:3]
    reference = outputs(run(LocalTarget(tiny_target, kv_pool=False, fast=False), prompts, method="target-only",
                            max_new_tokens=32, progress=False, fast=False))
    target = LocalTarget(cuda_target, fast=backend)
    frame = run(target, prompts, method=GREEDY_METHODS, draft=cuda_draft, k=4, max_new_tokens=32, progress=False,
                fast=backend)
    got = outputs(frame)
    for method in GREEDY_METHODS:
        for index in range(len(prompts)):
            assert got[(method, index)] == reference[("target-only", index)], (backend, method, index)
    assert target.fast.backend == backend and target.fast.stats["bucketed"] > 0
    assert (frame["target_forward_s"] > 0).all()


def test_long_prompts_replay_prefill_graphs_with_eager_tokens(cuda_target, tiny_target):
    """Prompts of 100 and 300 tokens through captured prefill chunks (one row of logits each), then greedy
    steps: the CPU's eager tokens; the graphs' outputs are one row, not bucket x vocab."""
    prompts = [(PROMPTS[0] * 40)[:100], (PROMPTS[1] * 40)[:300]]
    reference = outputs(run(LocalTarget(tiny_target, kv_pool=False, fast=False), prompts, method="target-only",
                            max_new_tokens=16, progress=False, fast=False))
    target = LocalTarget(cuda_target, fast="cudagraph")
    got = outputs(run(target, prompts, method="target-only", max_new_tokens=16, progress=False, fast="cudagraph",
                      warmup=False))  # (run's warm-up would prefill the first prompt once more)
    assert got == reference
    assert target.fast.stats["prefill"] == 3 and target.fast.stats["eager"] == 0
    prefill_outputs = [out for key, (_, _, out) in target.fast._graphs.items() if key[0] == "prefill"]
    assert prefill_outputs and all(out.shape[:2] == (1, 1) for out in prefill_outputs)


@pytest.mark.parametrize("backend", ["cudagraph", "compile"])
def test_batched_verifies_on_cuda_equal_lone_ones(cuda_target, cuda_draft, backend):
    batched, alone = LocalTarget(cuda_target, fast=backend), LocalTarget(cuda_target, kv_pool=False, fast=False)
    tree = TreeDrafter(cuda_draft, cuda_target.vocab_size, beam=2, branch=2, max_depth=3)
    drafters = [ModelDrafter(cuda_draft, 96), None, tree]
    assert_batches_match_lone_verifies(batched, alone, PROMPTS[:3], drafters, steps=6)
    assert batched.fast.stats["batched"] == 6
    for name in ("s0", "s1", "s2"):
        batched.close(name), alone.close(name)
    assert_batches_match_lone_verifies(batched, alone, PROMPTS[1:], [None, ModelDrafter(cuda_draft, 96), tree],
                                       steps=3)


def test_graphs_are_shared_by_sessions_and_captured_again_after_growth(cuda_target):
    """A lone step replays one graph per shape whatever the session (a batch of one pool row); growing the
    pool drops every graph (their memory pool with them), and later captures start a pool of their own
    rather than naming the freed one (PyTorch's allocator asserted on that)."""
    target = LocalTarget(cuda_target, fast="cudagraph")
    alone = LocalTarget(cuda_target, kv_pool=False, fast=False)
    for round_ in range(3):
        names = [f"r{round_}s{i}" for i in range(round_ + 1)]  # 1, 2, 3 sessions: the pool grows
        for name in names:
            for each in (target, alone):
                each.prefill(name, PROMPTS[round_])
            verdicts = [each.verify(name, DraftTree.chain([5, 6]), SamplingParams(), 0) for each in (target, alone)]
            assert verdicts[0].accepted_path == verdicts[1].accepted_path
            assert target.committed(name) == alone.committed(name)
        captured = set(target.fast._graphs)
        assert captured and all(key[:2] == ("batch", 1) for key in captured)
        for name in names:
            target.close(name), alone.close(name)
        target.prefill("again", PROMPTS[round_])
        target.verify("again", DraftTree.chain([5, 6]), SamplingParams(), 0)
        assert set(target.fast._graphs) == captured  # a new session captured nothing
        target.close("again")


@pytest.mark.parametrize("rule", ["rejection", "sample-match"])
def test_sampled_runs_on_cuda_equal_eager_with_the_same_seed(cuda_target, cuda_draft, rule):
    sampling = SamplingParams(temperature=1.0, rule=rule)
    eager = outputs(run(LocalTarget(cuda_target, kv_pool=False, fast=False), PROMPTS[:2], method="chain",
                        draft=cuda_draft, k=4, max_new_tokens=30, sampling=sampling, progress=False, seed=3, fast=False))
    fast = outputs(run(LocalTarget(cuda_target, fast="cudagraph"), PROMPTS[:2], method="chain", draft=cuda_draft,
                       k=4, max_new_tokens=30, sampling=sampling, progress=False, seed=3, fast="cudagraph"))
    assert fast == eager


def test_sample_match_on_cuda_draws_the_cpus_text_under_every_draft(cuda_target, cuda_draft, tiny_target):
    """Under sample-match a seed fixes the text whatever was drafted (sampling/streams: the target's draw at each
    position comes from a CPU generator keyed by the position): chain, chain-confident and a coupled dynamic tree
    on the captured GPU target give target-only's text, and the GPU's text is the CPU's (fp32)."""
    sampling = SamplingParams(temperature=1.0, rule="sample-match")
    methods = ["target-only", "chain", "chain-confident", "tree"]
    settings = dict(k=4, max_new_tokens=30, sampling=sampling, progress=False, seed=11)
    cpu = outputs(run(LocalTarget(tiny_target, kv_pool=False, fast=False), PROMPTS[:2], method="target-only",
                      fast=False, **settings))
    gpu = outputs(run(LocalTarget(cuda_target, fast="cudagraph"), PROMPTS[:2], method=methods, draft=cuda_draft,
                      fast="cudagraph", **settings))
    for method in methods:
        for index in range(2):
            assert gpu[(method, index)] == cpu[("target-only", index)], (method, index)


def test_sampled_sd_on_cuda_follows_the_target():
    """Verification on the device (captured target, chain rejection): the first two tokens' marginals."""
    from test_distributions import P_VALUE_FLOOR, chi_square_p, target_marginals

    vocab = 16
    target = tiny_model(seed=3, vocab_size=vocab)
    draft = tiny_model(seed=4, vocab_size=vocab, noise_from=target, noise_scale=0.01)
    sampling = SamplingParams(temperature=1.5, rule="rejection", draft_top_k=8)
    local = LocalTarget(on_cuda(target), fast="cudagraph")
    drafter = ModelDrafter(on_cuda(draft), 64)
    prompt = [1, 2, 14, 1, 2, 15, 1, 2, 5, 1, 2]
    first, second = np.zeros(vocab), np.zeros(vocab)
    accepted = 0
    for draw in range(1000):
        result = generate(local, drafter, prompt, Decoding(3, 2, sampling), seed=5_000 + draw)
        accepted += sum(r.accepted for r in result.records)
        first[result.output_ids[0]] += 1
        second[result.output_ids[1]] += 1
    first_p, second_p = target_marginals(target, prompt, sampling, vocab)
    assert accepted > 100
    assert chi_square_p(first, first_p) > P_VALUE_FLOOR and chi_square_p(second, second_p) > P_VALUE_FLOOR


@pytest.mark.parametrize("fast", ["off", None])
def test_a_worker_serves_on_cuda(tiny_target, fast):
    """`specbench worker --device cuda [--fast]`: remote greedy equals local CPU greedy; profile and stats."""
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget

    from worker_helpers import DRAFT, TARGET, ThreadWorker

    worker = ThreadWorker(model=ModelSpec(TARGET, device="cuda"), draft=ModelSpec(DRAFT, device="cuda"),
                          device="cuda", fast=fast)
    try:
        remote = RemoteTarget(worker.endpoint)
        draft = tiny_model(1, noise_from=tiny_model(0), noise_scale=0.005)
        methods = ["target-only", "chain", "prompt-lookup", "server-only"]
        got = outputs(run(remote, PROMPTS, method=methods, draft=draft, max_new_tokens=24, progress=False))
        reference = outputs(run(tiny_target, PROMPTS, method="target-only", max_new_tokens=24, progress=False))
        for method in methods:
            for index in range(len(PROMPTS)):
                assert got[(method, index)] == reference[("target-only", index)], (method, index)
        profile = remote.profile(tokens=[1, 4], contexts=[16], repeats=2, batches=[1, 2])
        assert len(profile["rows"]) == 4 and all(row["median_s"] > 0 for row in profile["rows"])
        assert remote.info["device"].startswith("cuda") and remote.stats()["errors"] == 0
        assert (worker.worker.ops.target.fast is None) == (fast == "off")  # fast by default on CUDA
    finally:
        worker.stop()


@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_bitsandbytes_targets_load_and_decode_on_cuda(tmp_path, quantization):
    """A model directory (random Qwen2 weights, a tokenizer built here) loaded 8-/4-bit on the GPU: fewer
    weight bytes than fp32, and SD over the quantized target gives its own greedy tokens."""
    pytest.importorskip("bitsandbytes")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    from tokenizers_for_tests import byte_level_bpe

    tokenizer = byte_level_bpe()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    full = load_model(ModelSpec(str(tmp_path), dtype="float32", device="cuda"))
    quantized = load_model(ModelSpec(str(tmp_path), dtype="float32", device="cuda", quantization=quantization))
    assert quantized.weight_bytes < 0.5 * full.weight_bytes
    assert LocalTarget(quantized).fast is None and LocalTarget(full).fast.backend == "cudagraph"  # the defaults
    prompts = [list(range(3, 40)), [5, 6, 7, 5, 6, 7, 5, 6]]
    frame = run(quantized, prompts, method=["target-only", "chain", "prompt-lookup"], draft=full, k=4,
                max_new_tokens=24, progress=False)
    got = outputs(frame)
    for method in ("chain", "prompt-lookup"):
        for index, prompt in enumerate(prompts):
            alone, sd = got[("target-only", index)], got[(method, index)]
            # quantized logits within NEAR_TIE_SHARE of their range are a tie that rounding may break either way
            # (8-bit matmuls pick outlier columns per batch, so a row's result depends on its batch's shape)
            found = divergence(quantized.model, prompt, alone, sd)
            assert found is None or found.near_tie, (quantization, method, index, found)
