"""The shared KV pool gives every session what Hugging Face's own cache gives it, while growing,
compacting tree paths in place and batching over consecutive or scattered slots."""
import gc

import pytest
import torch

from specbench.decode.batch import VerifyRequest, verify_batch
from specbench.decode.drafters import ModelDrafter
from specbench.decode.kv_pool import KVPool, PooledCache
from specbench.decode.target import LocalTarget
from specbench.decode.tree_drafters import TreeDrafter
from specbench.types import DraftTree, SamplingParams

from conftest import PROMPTS, assert_batches_match_lone_verifies


def _tiny_pool(target: LocalTarget) -> LocalTarget:
    """One slot of 8 positions to start with: every test below makes it grow both ways."""
    target.pool = KVPool(len(target.pool.keys), slots=1, capacity=8)
    return target


def test_pooled_sessions_decode_like_dynamic_caches(tiny_target, tiny_draft):
    """Chains and trees, lone verifies, with the pool growing in slots and capacity mid-decode:
    the same verdicts, committed tokens and (to float rounding) logits as per-session DynamicCaches."""
    pooled, plain = _tiny_pool(LocalTarget(tiny_target)), LocalTarget(tiny_target, kv_pool=False)
    assert plain.pool is None
    drafters = [ModelDrafter(tiny_draft, 96), TreeDrafter(tiny_draft, 96, widths=(3, 2, 1))]
    greedy, generator = SamplingParams(), torch.Generator().manual_seed(0)
    for i, prompt in enumerate(PROMPTS[:3]):
        pooled.prefill(f"s{i}", prompt)
        plain.prefill(f"s{i}", prompt)
    for step in range(14):
        for i in range(3):
            context = plain.committed(f"s{i}")
            tree = drafters[(i + step) % 2].propose(context, 2 + step % 3, greedy, generator)
            got = pooled.verify(f"s{i}", tree, greedy, step)
            want = plain.verify(f"s{i}", tree, greedy, step)
            assert (got.accepted_path, got.bonus_token) == (want.accepted_path, want.bonus_token)
            assert pooled.committed(f"s{i}") == plain.committed(f"s{i}")
    assert pooled.pool.slots >= 3 and pooled.pool.capacity >= len(pooled.committed("s0"))
    for i in range(3):  # the cached keys themselves, position by position
        ours, theirs = pooled.sessions[f"s{i}"].cache, plain.sessions[f"s{i}"].cache
        assert ours.get_seq_length() == theirs.get_seq_length()
        for mine, reference in zip(ours.layers, theirs.layers):
            torch.testing.assert_close(mine.keys, reference.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(mine.values, reference.values, rtol=1e-4, atol=1e-5)


def test_batches_over_scattered_slots_equal_lone_dynamic_caches(tiny_target, tiny_draft):
    """Closing sessions leaves holes: a batch over slots 0, 2, 4 attends over a copy, not a view,
    and still gives each row its lone verdict; reopened sessions reuse the freed slots."""
    batched, plain = _tiny_pool(LocalTarget(tiny_target)), LocalTarget(tiny_target, kv_pool=False)
    for i in range(5):
        batched.prefill(f"s{i}", PROMPTS[i % 4][: 3 + i])
        plain.prefill(f"s{i}", PROMPTS[i % 4][: 3 + i])
    for name in ("s1", "s3"):
        batched.close(name)
        plain.close(name)
    gc.collect()
    live = ["s0", "s2", "s4"]
    assert sorted(batched.sessions[s].cache.slot for s in live) == [0, 2, 4]
    drafter, greedy, generator = TreeDrafter(tiny_draft, 96, widths=(2, 2)), SamplingParams(), torch.Generator()
    for step in range(8):
        requests = [VerifyRequest(s, drafter.propose(plain.committed(s), 3, greedy, generator), greedy, step)
                    for s in reversed(live)]  # out of slot order on purpose
        for request, verdict in zip(requests, verify_batch(batched, requests)):
            lone = plain.verify(request.session, request.tree, greedy, step)
            assert (verdict.accepted_path, verdict.bonus_token) == (lone.accepted_path, lone.bonus_token)
            assert batched.committed(request.session) == plain.committed(request.session)
    batched.prefill("again", PROMPTS[1])
    assert batched.sessions["again"].cache.slot == 1  # the lowest free slot


def test_slots_are_released_when_sessions_go(tiny_target):
    """Re-prefilling a session many times (a client restarting) or closing it never leaks pool rows."""
    target = LocalTarget(tiny_target)
    target.prefill("a", PROMPTS[0])
    in_use = target.pool.in_use
    for _ in range(20):
        target.prefill("a", PROMPTS[1])
        gc.collect()
    assert target.pool.in_use == in_use
    target.close("a")
    gc.collect()
    assert target.pool.in_use == in_use - 1


def test_packed_batch_over_consecutive_slots_reads_the_pool_in_place(tiny_target):
    """The packed forward writes each segment into its own row, and with consecutive slots the
    attention reads a view of the pool's storage (nothing copied); scattered slots get a copy."""
    from specbench.decode.kv_pool import packed_cache
    from specbench.decode.packed_attention import Packing

    target = LocalTarget(tiny_target)
    assert target.packed
    for i in range(3):
        target.prefill(f"s{i}", PROMPTS[i])
    pool, pasts = target.pool, [len(PROMPTS[i]) - 1 for i in range(3)]
    heads, head_dim = pool.keys[0].shape[1], pool.keys[0].shape[3]
    new = torch.arange(3 * heads * head_dim, dtype=torch.float32).view(1, heads, 3, head_dim)
    keys, _ = packed_cache(pool, [0, 1, 2], pasts, [2, 0, 1]).layers[0].update(new, new)
    assert keys.data_ptr() == pool.keys[0].data_ptr()
    torch.testing.assert_close(pool.keys[0][0, :, pasts[0]:pasts[0] + 2], new[0, :, :2])
    torch.testing.assert_close(pool.keys[0][2, :, pasts[2]], new[0, :, 2])
    masks = [torch.zeros(n, p + n) for p, n in zip(pasts, [2, 0, 1])]
    rows = Packing([0, 1, 2], pasts, [2, 0, 1], masks)._rows(pool.keys[0], 4)
    assert rows.data_ptr() == pool.keys[0].data_ptr()
    assert Packing([0, 2], pasts[:2], [2, 1], masks[:2])._rows(pool.keys[0], 4).data_ptr() != pool.keys[0].data_ptr()
    assert isinstance(target.sessions["s0"].cache, PooledCache)


def test_models_with_sliding_window_layers_keep_their_own_caches():
    """A model whose cache mixes sliding-window layers (Gemma 3) gets no pool: its layers drop old
    positions, which one shared row per session does not model."""
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    from specbench.decode.kv_pool import pool_for

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    assert pool_for(Gemma3ForCausalLM(config)) is None


def test_running_out_of_memory_while_growing_loses_nothing(tiny_target, monkeypatch):
    """The pool cannot grow (allocation fails half-way): that step fails with the allocator's error,
    the pool and the session are as before, and the next step, with memory back, decodes correctly."""
    import specbench.decode.kv_pool as kv_pool

    target, plain = _tiny_pool(LocalTarget(tiny_target)), LocalTarget(tiny_target, kv_pool=False)
    target.prefill("s", PROMPTS[0][:5])
    plain.prefill("s", PROMPTS[0][:5])
    shape, committed = tuple(target.pool.keys[0].shape), target.committed("s")
    allocations, real_zeros = [], torch.zeros

    def failing_zeros(*args, **kwargs):
        allocations.append(args)
        if len(allocations) == 3:
            raise RuntimeError("out of memory (simulated)")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(kv_pool.torch, "zeros", failing_zeros)
    chain = DraftTree.chain([3, 4, 5, 6, 7])  # 4 cached + 6 new > 8 positions: the pool must grow
    try:
        target.verify("s", chain, SamplingParams(), 0)
        raise AssertionError("the step should have failed")
    except RuntimeError as error:
        assert "out of memory" in str(error)
    assert tuple(target.pool.keys[0].shape) == shape and target.committed("s") == committed
    monkeypatch.setattr(kv_pool.torch, "zeros", real_zeros)
    got, want = target.verify("s", chain, SamplingParams(), 0), plain.verify("s", chain, SamplingParams(), 0)
    assert (got.accepted_path, got.bonus_token) == (want.accepted_path, want.bonus_token)
    assert target.committed("s") == plain.committed("s")


def test_a_pool_over_its_byte_limit_refuses_to_grow_and_keeps_serving(tiny_target):
    """The worker bounds the pool by --max-kv-gib: a step that would grow it past the limit is refused
    with the numbers, its session is unchanged and other steps go on."""
    import pytest

    from specbench.types import SpecbenchError

    target = _tiny_pool(LocalTarget(tiny_target))
    target.prefill("s", PROMPTS[0][:5])
    target.pool.max_bytes = target.pool.nbytes()  # full: no room to grow
    committed = target.committed("s")
    with pytest.raises(SpecbenchError, match=r"KV pool: 1 sessions x 64 positions .* --max-kv-gib"):
        target.verify("s", DraftTree.chain([3, 4, 5, 6, 7]), SamplingParams(), 0)
    assert target.committed("s") == committed
    verdict = target.verify("s", DraftTree.chain([3]), SamplingParams(), 0)  # fits in the 8 positions held
    assert target.committed("s") == committed + [3][:len(verdict.accepted_path)] + [verdict.bonus_token]


def tiny_gemma(seed: int, noise: float = 0.0):
    """A tiny Gemma 3 whose sliding-window layers (window 4) drop old positions after a few tokens;
    with `noise`, seed 0's weights plus Gaussian noise (a draft that agrees only sometimes)."""
    import torch
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    from specbench.models.loaded import LoadedModel
    from specbench.models.spec import ModelSpec

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], initializer_range=0.5,
                              tie_word_embeddings=False)
    torch.manual_seed(0 if noise else seed)
    model = Gemma3ForCausalLM(config).eval()
    if noise:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * torch.randn(parameter.shape, generator=generator))
    return LoadedModel(spec=ModelSpec(f"tiny-gemma-{seed}-{noise}"), model=model, tokenizer=None)


def test_sliding_window_caches_roll_back_past_their_window():
    """Rejected drafts are cropped long after the window filled (the target's cache by the rejected
    tail, the draft's back to the common prefix, re-fed when its window no longer holds it): with a
    draft that is mostly rejected, greedy output equals target-only, token for token. Trees, which
    need a custom mask, are refused with a reason."""
    from specbench.api import outputs, run
    from specbench.types import SpecbenchError

    target, draft = tiny_gemma(0), tiny_gemma(1, noise=0.3)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    frame = run(target, prompts, method=["target-only", "chain"], draft=draft, k=4, max_new_tokens=40,
                progress=False, chat=False)
    got = outputs(frame)
    for index in range(len(prompts)):
        assert len(got[("target-only", index)]) == 40 and len(set(got[("target-only", index)])) > 3
        assert got[("chain", index)] == got[("target-only", index)]
    steps = frame[frame["method"] == "chain"]
    assert (steps["drafted"] > steps["accepted"]).sum() > 10  # rolled back again and again
    with pytest.raises(SpecbenchError, match="sliding-window layers"):
        run(target, prompts, method="tree", draft=draft, k=4, max_new_tokens=8, progress=False, chat=False)


def test_profile_measures_contexts_longer_than_a_sliding_window():
    from specbench.decode.profile import forward_latency_grid

    rows = forward_latency_grid(tiny_gemma(0).model, tokens=[1, 3], contexts=[16], repeats=2, warmup=1)
    assert [r["tokens"] for r in rows] == [1, 3] and all(r["median_s"] > 0 for r in rows)


def test_a_shared_sliding_window_target_verifies_each_session_as_alone():
    """A Gemma 3 target verifying several sessions past its window: its layers hold only the window,
    so a padded batch cannot be built from them (it crashed before); each session is verified alone
    and gets exactly what a lone target gives it."""
    target, draft = tiny_gemma(0), tiny_gemma(1, noise=0.3)
    batched, alone = LocalTarget(target), LocalTarget(target)
    drafters = [ModelDrafter(draft, 64), ModelDrafter(draft, 64), None]
    assert_batches_match_lone_verifies(batched, alone, [list(range(1, 11)), [11, 12, 13], [20]], drafters, steps=12)
    assert len(batched.committed("s0")) > 10 + 12  # well past the window of 4


@pytest.mark.parametrize("count, mask_kind", [(1, None), (1, "bool"), (3, "bool"), (16, "additive"), (17, "bool")])
def test_gqa_attention_on_a_cpu_folds_query_heads_and_equals_transformers_sdpa(count, mask_kind, monkeypatch):
    """Up to FOLD queries of a GQA layer attend folded (each key/value head's query heads as its rows, the
    mask tiled per head) over the cache as it lies in the pool (a strided view), equal to transformers'
    own SDPA attention; more queries, or options the fold lacks, go to transformers' attention."""
    from types import SimpleNamespace

    from transformers.integrations import sdpa_attention

    from specbench.decode.packed_attention import FOLD, sdpa

    torch.manual_seed(0)
    pool = torch.randn(2, 3, 3, 40, 8)  # [keys/values, slots, kv heads, capacity, head dim]
    keys, values = pool[0, 1:, :, :29], pool[1, 1:, :, :29]  # two rows, 29 positions cached: strided views
    query = torch.randn(2, 12, count, 8)
    visible = torch.rand(2, 1, count, 29) > 0.3
    visible[..., 0] = True
    mask = {None: None, "bool": visible,
            "additive": torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)}[mask_kind]
    module = SimpleNamespace(num_key_value_groups=4, is_causal=True, training=False)
    wanted, _ = sdpa_attention.sdpa_attention_forward(module, query, keys, values, mask, dropout=0.0, scaling=0.3)

    def refused(*args, **kwargs):
        raise AssertionError("transformers' attention was called where the fold applies")

    if count <= FOLD:
        monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", refused)
    got, _ = sdpa(module, query, keys, values, mask, dropout=0.0, scaling=0.3, use_cache=True)
    assert got.shape == (2, count, 12, 8)
    torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)
    if count <= FOLD:  # an option the fold does not honour goes to transformers
        with pytest.raises(AssertionError, match="fold applies"):
            sdpa(module, query, keys, values, mask, scaling=0.3, softcap=30.0)


def test_a_draft_models_steps_go_through_the_folded_attention_and_draft_as_before():
    """A model drafter installs specbench's attention on its model (its one-token steps fold on a CPU) and
    drafts the same greedy chain as transformers' own attention over an identical model."""
    from specbench.decode.drafters import ModelDrafter
    from specbench.decode.packed_attention import ATTENTION
    from specbench.models.tiny import tiny_model

    drafted, plain = tiny_model(seed=1), tiny_model(seed=1)
    drafter = ModelDrafter(drafted, target_vocab_size=drafted.vocab_size)
    assert drafted.model.config._attn_implementation == ATTENTION
    assert plain.model.config._attn_implementation == "sdpa"
    context = list(PROMPTS[0]) * 3
    chain = drafter.propose(context, 6, SamplingParams(), torch.Generator().manual_seed(0)).tokens
    with torch.no_grad():
        wanted = plain.model.generate(torch.tensor([context]), max_new_tokens=6, do_sample=False)[0, len(context):]
    assert list(chain) == wanted.tolist()
