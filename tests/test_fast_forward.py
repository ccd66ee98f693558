"""The fast path (fixed-shape steps over static caches) gives the tokens the eager path gives."""
import pytest

from specbench.api import outputs, run
from specbench.decode.batch import VerifyRequest, verify_batch
from specbench.decode.drafters import ModelDrafter
from specbench.decode.fast_forward import BUCKETS, FastForward
from specbench.decode.static_kv import WIDTH_STEP
from specbench.decode.target import LocalTarget
from specbench.types import DraftTree, SamplingParams, SpecbenchError

from conftest import PROMPTS, assert_batches_match_lone_verifies

# Long enough to cross an attended width: prompt + 40 new tokens > WIDTH_STEP positions.
LONG = [(PROMPTS[0] * 20)[:WIDTH_STEP - 20], PROMPTS[1]]
METHODS = ["target-only", "chain", "tree", "fixed-tree", "self-draft", "prompt-lookup", "prompt-lookup-tree"]


def _eager_reference(model, prompts, max_new_tokens, sampling=None):
    frame = run(LocalTarget(model, kv_pool=False), prompts, method="target-only", max_new_tokens=max_new_tokens,
                sampling=sampling, progress=False)
    return outputs(frame)


def test_static_shapes_equal_eager_for_every_method_across_widths(tiny_target, tiny_draft):
    """The fixed shapes themselves (padding to a bucket, a width-cut mask, trees compacted in place,
    rollback as bookkeeping), run uncompiled: token for token what eager target-only gives."""
    reference = _eager_reference(tiny_target, LONG, 40)
    fast = LocalTarget(tiny_target, fast="static")
    frame = run(fast, LONG, method=METHODS, draft=tiny_draft, k=5, max_new_tokens=40, progress=False, fast="static")
    got = outputs(frame)
    for method in METHODS:
        for index in range(len(LONG)):
            assert got[(method, index)] == reference[("target-only", index)], (method, index)
    chain = frame[frame.method == "chain"]
    assert 0 < chain["accepted"].sum() < chain["drafted"].sum()  # rollbacks happened
    widths = {width for _, width in fast.fast.shapes}
    assert widths == {WIDTH_STEP, 2 * WIDTH_STEP}  # the long prompt crossed a width
    # its prefill, longer than every step bucket, ran as a fixed-shape prefill chunk, never eagerly
    assert fast.fast.stats["prefill"] > 0 and fast.fast.stats["eager"] == 0


def test_a_long_prompt_runs_in_fixed_shape_chunks_with_eager_results(tiny_target):
    """A prompt longer than every step bucket, on the backends that replay shapes uncompiled: chunks of at most
    256 tokens padded to a prefill bucket, each reading one row of logits; the last row, the cache and the
    tokens decoded after it are eager's. Compiled, a prompt still runs eagerly (a compile per shape)."""
    import torch

    from specbench.decode.fast_forward import PREFILL_BUCKETS

    prompt = (PROMPTS[0] * 40)[:300]
    eager = LocalTarget(tiny_target, kv_pool=False, fast=False)
    fast = LocalTarget(tiny_target, fast="static")
    for target in (eager, fast):
        target.prefill("s", prompt)
        for _ in range(12):
            target.verify("s", DraftTree.chain([]), SamplingParams(), 0)
    assert fast.committed("s") == eager.committed("s")
    assert fast.fast.stats["prefill"] == 2 and fast.fast.stats["eager"] == 0  # 256 + 43 (padded to 64)
    assert {(64, 384), (256, 256)} <= fast.fast.shapes and PREFILL_BUCKETS[-1] == 256
    forward = FastForward(tiny_target.model, 3 * WIDTH_STEP, "static")
    cache = forward.new_cache()
    last = forward(cache, prompt, logits_to_keep=1)
    with torch.inference_mode():
        reference = tiny_target.model(input_ids=torch.tensor([prompt])).logits[0, -1:]
    assert last.shape == reference.shape and cache.length == len(prompt)
    torch.testing.assert_close(last, reference, rtol=1e-4, atol=1e-4)
    compiled = FastForward(tiny_target.model, 3 * WIDTH_STEP, "compile")
    compiled(compiled.new_cache(), prompt, logits_to_keep=1)
    assert compiled.stats == {"bucketed": 0, "eager": 1, "batched": 0, "prefill": 0}


def test_tree_drafts_and_self_draft_views_take_the_fast_path(tiny_target, tiny_draft):
    """A tree drafter's level forwards (tree masks, positions by depth) through fixed shapes propose the
    very trees eager drafting does, and `fast` gives tree and self-draft methods their FastForward."""
    import torch

    from specbench.decode.tree_drafters import TreeDrafter
    from specbench.methods import DraftSource, make_drafter

    shape = dict(beam=3, branch=2, max_depth=4)
    eager = TreeDrafter(tiny_draft, tiny_target.vocab_size, **shape)
    fast = TreeDrafter(tiny_draft, tiny_target.vocab_size, fast=FastForward(tiny_draft.model, 256, "static"), **shape)
    context = list(LONG[0][:40])
    for step in range(6):
        trees = [drafter.propose(context, 10, SamplingParams(), torch.Generator().manual_seed(step))
                 for drafter in (eager, fast)]
        assert (trees[0].tokens, trees[0].parents) == (trees[1].tokens, trees[1].parents), step
        proposed_at = len(context)
        context += [trees[0].tokens[0], 7]  # the context moves on: both caches roll back and catch up
    assert fast.fast.stats["bucketed"] >= 6 and fast.cache.length == proposed_at  # tree tokens cropped off
    source = DraftSource(LocalTarget(tiny_target), tiny_target, tiny_draft, fast="static")
    for method in ("tree", "fixed-tree", "self-draft", "chain"):
        assert make_drafter(method, source).fast is not None, method


def test_compiled_steps_equal_eager_greedy(tiny_target, tiny_draft):
    """The golden fp32 greedy test through torch.compile (target and draft compiled): a few graphs, one
    per bucket x width, and the same tokens as eager target-only."""
    prompts = PROMPTS[:2]
    reference = _eager_reference(tiny_target, prompts, 24)
    fast = LocalTarget(tiny_target, fast="compile")
    frame = run(fast, prompts, method=["target-only", "chain"], draft=tiny_draft, k=3, max_new_tokens=24,
                progress=False, fast="compile")
    got = outputs(frame)
    for method in ("target-only", "chain"):
        for index in range(len(prompts)):
            assert got[(method, index)] == reference[("target-only", index)], (method, index)
    assert fast.fast.backend == "compile" and fast.fast._compiled is not None
    assert fast.fast.shapes <= {(b, WIDTH_STEP) for b in BUCKETS} and len(fast.fast.shapes) >= 2


def test_sampled_rules_equal_eager_with_the_same_seed(tiny_target, tiny_draft):
    """Verification is unchanged by the fast path: sampled runs with the same seed give the same tokens."""
    sampling = SamplingParams(temperature=1.0, rule="rejection")
    eager = outputs(run(LocalTarget(tiny_target, kv_pool=False), PROMPTS[:2], method="chain", draft=tiny_draft,
                        k=4, max_new_tokens=30, sampling=sampling, progress=False, seed=3))
    fast = outputs(run(LocalTarget(tiny_target, fast="static"), PROMPTS[:2], method="chain", draft=tiny_draft,
                       k=4, max_new_tokens=30, sampling=sampling, progress=False, seed=3, fast="static"))
    assert fast == eager


@pytest.mark.parametrize("backend", ["static", "compile"])
def test_a_fast_target_verifies_a_batch_in_one_fixed_shape_forward(tiny_target, tiny_draft, backend):
    """Sessions in the static pool verified together (chains, a tree, an empty draft; static: the batch
    padded to a power of two with a scratch slot; compiled: one graph whatever the rows) get the
    verdicts lone eager verifies give, through pool growth, and so do sessions opened after others closed."""
    from specbench.decode.tree_drafters import TreeDrafter

    batched, alone = LocalTarget(tiny_target, fast=backend), LocalTarget(tiny_target, kv_pool=False)
    tree = TreeDrafter(tiny_draft, tiny_target.vocab_size, beam=2, branch=2, max_depth=3)
    drafters = [ModelDrafter(tiny_draft, 96), None, tree]
    assert_batches_match_lone_verifies(batched, alone, PROMPTS[:3], drafters, steps=6)
    fast = batched.fast
    padded = backend == "static"  # as captured graphs are: 3 rows + 1 padding; compiled, rows are dynamic
    assert fast.stats["batched"] == 6 and {size for size, _, _ in fast.batch_shapes} == ({4} if padded else {3})
    assert fast.pool.slots == 4 and fast.pool.generation == 3  # grew 1 -> 2 -> 4 under the sessions
    for name in ("s0", "s1", "s2"):
        batched.close(name), alone.close(name)
    assert fast.pool.in_use == (1 if padded else 0)  # the padding rows' scratch slot, once a batch was padded
    assert_batches_match_lone_verifies(batched, alone, PROMPTS[1:], [None, ModelDrafter(tiny_draft, 96), tree],
                                       steps=3)
    assert fast.pool.generation == 3  # the closed sessions' slots served the new ones
    bad = [VerifyRequest("s0", DraftTree.chain([10_000]), SamplingParams(), 0)]
    assert isinstance(verify_batch(batched, bad)[0], SpecbenchError)  # an error per request, not a crash


def test_a_batch_no_bucket_holds_runs_its_rows_alone(tiny_target):
    """A draft longer than every bucket (or one row) takes the lone path, with the same verdicts."""
    batched, alone = LocalTarget(tiny_target, fast="static"), LocalTarget(tiny_target, kv_pool=False)
    for name, prompt in zip("ab", PROMPTS):
        batched.prefill(name, prompt), alone.prefill(name, prompt)
    long_chain = DraftTree.chain(list(range(3, 3 + BUCKETS[-1] + 4)))
    requests = [VerifyRequest("a", long_chain, SamplingParams(), 0),
                VerifyRequest("b", DraftTree.chain([5]), SamplingParams(), 0)]
    before = batched.fast.stats["batched"]
    for request, verdict in zip(requests, verify_batch(batched, requests)):
        lone = alone.verify(request.session, request.tree, request.sampling, request.seed)
        assert (verdict.accepted_path, verdict.bonus_token) == (lone.accepted_path, lone.bonus_token)
        assert batched.committed(request.session) == alone.committed(request.session)
    assert batched.fast.stats["batched"] == before


def test_static_cache_bookkeeping_and_refusals(tiny_target):
    target = LocalTarget(tiny_target, fast="static", fast_capacity=WIDTH_STEP)
    assert target.max_context == WIDTH_STEP
    target.prefill("s", PROMPTS[0])
    committed = target.committed("s")
    target.verify("s", DraftTree(tokens=(3, 4, 5), parents=(-1, -1, 0)), SamplingParams(), 0)  # a tree
    cache = target.sessions["s"].cache
    assert cache.length == len(target.committed("s")) - 1 and target.committed("s")[:len(committed)] == committed
    with pytest.raises(SpecbenchError, match="exceeds the target's context"):
        target.verify("s", DraftTree.chain([1] * WIDTH_STEP), SamplingParams(), 0)
    assert cache.length == len(target.committed("s")) - 1  # the refused step left the session as it was
    for captured in ("cudagraph", "compiled-graph"):
        with pytest.raises(SpecbenchError, match=f"{captured} backend needs a CUDA model"):
            FastForward(tiny_target.model, WIDTH_STEP, captured)
    with pytest.raises(SpecbenchError, match="fast backend must be one of"):
        FastForward(tiny_target.model, WIDTH_STEP, "turbo")


def test_the_fast_path_is_on_by_default_for_unquantized_cuda_models_only(tiny_target):
    """`fast=None` (the default): CUDA graphs where they were measured to pay, eager on a CPU, for a
    quantized model and where a static cache cannot model the layers; explicit choices pass through."""
    import types

    import torch

    from specbench.decode.fast_forward import chosen_backend

    def stub(device, quantized=False, config=tiny_target.model.config):
        weight = types.SimpleNamespace(device=torch.device(device))
        return types.SimpleNamespace(config=config, hf_quantizer=object() if quantized else None,
                                     get_input_embeddings=lambda: types.SimpleNamespace(weight=weight))

    assert chosen_backend(None, stub("cuda")) == "cudagraph"
    assert chosen_backend(None, stub("cpu")) is False and chosen_backend(None, tiny_target.model) is False
    assert chosen_backend(None, stub("cuda", quantized=True)) is False
    from test_kv_pool import tiny_gemma

    assert chosen_backend(None, stub("cuda", config=tiny_gemma(0).model.config)) is False
    assert chosen_backend("off", stub("cuda")) is False and chosen_backend(False, stub("cuda")) is False
    assert chosen_backend(True, stub("cpu")) is True and chosen_backend("static", stub("cpu")) == "static"
    assert LocalTarget(tiny_target).fast is None  # CPU: eager unless asked


def test_sliding_window_models_are_refused_on_the_fast_path():
    from test_kv_pool import tiny_gemma

    with pytest.raises(SpecbenchError, match="sliding window"):
        LocalTarget(tiny_gemma(0), fast=True)


def test_profiles_of_the_fast_path_say_so_and_survive_a_round_trip(tiny_target, tmp_path):
    from specbench.decode.profile import forward_latency_grid
    from specbench.plan.library import load_profiles, save_profile
    from specbench.record import profile_model

    rows = forward_latency_grid(tiny_target.model, tokens=[1, 3], contexts=[20], repeats=2, fast="static")
    assert [r["tokens"] for r in rows] == [1, 3] and all(r["forward"] == "fast-static" for r in rows)
    rows = forward_latency_grid(tiny_target.model, tokens=[2], contexts=[20], batches=[1, 4], fast="static")
    assert [r["batch"] for r in rows] == [1, 4] and all(r["median_s"] > 0 for r in rows)
    profile, extra = profile_model(tiny_target, tokens=[1, 2], contexts=[16], repeats=2, fast="static")
    assert profile.forward == "fast-static"
    save_profile(profile, extra, folder=tmp_path)
    assert [p.forward for p in load_profiles(folder=tmp_path)] == ["fast-static"]


def test_the_gpu_benchmark_script_runs_on_a_cpu(tmp_path):
    """benchmarks/gpu.py waits for a GPU; its code path is checked here on tiny architectures."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, "gpu.py", "--device", "cpu", "--archs", "tiny", "tiny-draft", "--dtype", "float32",
                    "--backend", "static", "--tokens", "1", "4", "--contexts", "40", "--repeats", "2", "--steps", "6",
                    "--bandwidth-mib", "8", "--batches", "2", "--batch-tokens", "2", "--batch-contexts", "40",
                    "--prompts", "20", "100", "--step-tokens", "1", "4", "--out", str(out)],
                   cwd=root / "benchmarks", check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert {(r["arch"], r["batch"], r["tokens"]) for r in report["forwards"]} == {
        (a, b, n) for a in ("tiny", "tiny-draft") for b, n in ((1, 1), (1, 4), (2, 2))}
    assert all(r["fast_ms"] > 0 and r["floor_ms"] > 0 for r in report["forwards"])
    assert [r["forward"] for r in report["pairs"]] == ["eager", "fast"]
    assert all(r["sd_ms_per_token"] > 0 and r["mean_accepted"] >= 0 for r in report["pairs"])
    assert [(r["arch"], r["prompt"]) for r in report["prefills"]] == [
        (a, n) for a in ("tiny", "tiny-draft") for n in (20, 100)]
    assert [(r["arch"], r["tokens"]) for r in report["steps"]] == [
        (a, n) for a in ("tiny", "tiny-draft") for n in (1, 4)]
    assert all(r["lean_ms"] > 0 and r["hf_step_ms"] > 0 for r in report["steps"])
    assert all(r["fast_ms"] > 0 for r in report["prefills"]) and [r["chunks_replayed"] for r in report["prefills"]] == [0, 1] * 2


def test_the_gpu_worker_benchmark_runs_on_a_cpu(tmp_path):
    """benchmarks/gpu_worker.py (a worker under load on a GPU, and a step's parts) checked on a tiny
    architecture: a model directory it writes, a real worker process, a client process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    common = ["--device", "cpu", "--arch", "tiny", "--dtype", "float32", "--workers", "fast-static",
              "--prompt-tokens", "20"]
    for mode, out in ((["--clients", "1", "--rounds", "1", "--max-new-tokens", "8"], "load.json"),
                      (["--breakdown", "--breakdown-tokens", "16"], "parts.json")):
        subprocess.run([sys.executable, "gpu_worker.py", *common, *mode, "--out", str(tmp_path / out)],
                       cwd=root / "benchmarks", check=True, capture_output=True, timeout=300)
    load = json.loads((tmp_path / "load.json").read_text())
    assert [(r["worker"], r["clients"], r["tokens"]) for r in load["rows"]] == [("fast-static", 1, 8)]
    parts = json.loads((tmp_path / "parts.json").read_text())["breakdown"]
    assert [r["where"] for r in parts] == ["local, fast=False", "local, fast=None", "worker fast-static"]
    assert all(r["wall_ms"] >= r["step_ms"] > 0 for r in parts) and parts[2]["network_ms"] > 0


def test_static_caches_are_bounded_and_freed_with_their_sessions(tiny_target):
    """A worker's --max-kv-gib bounds a fast target's caches (each holds its full capacity): one session
    too many is refused by name, the others keep serving, and closing one makes room."""
    target = LocalTarget(tiny_target, fast="static", fast_capacity=WIDTH_STEP)
    target.prefill("a", PROMPTS[0])
    one = target.sessions["a"].cache.nbytes()
    target.fast.max_bytes = int(1.5 * one)
    with pytest.raises(SpecbenchError, match="--max-kv-gib"):
        target.prefill("b", PROMPTS[1])
    target.verify("a", DraftTree.chain([3, 4]), SamplingParams(), 0)  # still serving
    target.close("a")
    target.prefill("b", PROMPTS[1])
    assert target.committed("b") == PROMPTS[1]
