"""Batched verification across sessions gives each session exactly what it gets alone."""
import pytest
import torch

from specbench.decode.batch import VerifyRequest, verify_batch
from specbench.decode.drafters import ModelDrafter, PromptLookupDrafter
from specbench.decode.packed_attention import SHORT
from specbench.decode.target import LocalTarget
from specbench.decode.tree_drafters import TreeDrafter
from specbench.types import DraftTree, SamplingParams

from conftest import PROMPTS

SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, rule="rejection"),
             SamplingParams(temperature=0.8, top_k=20, rule="sample-match")]


@pytest.mark.parametrize("layout", ["packed", "pool-padded", "copied-caches"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "rejection", "sample-match"])
def test_batched_verdicts_equal_lone_verdicts(tiny_target, tiny_draft, sampling, layout):
    """Ragged contexts, chains, fixed trees, empty trees, prompt-lookup tries and a chain longer than
    `packed_attention.SHORT` (it attends alone) in one batch; packed in the KV pool, padded over pool
    rows (a model whose attention takes no packed layout), and by copying per-session caches (models
    the pool does not take)."""
    batched = LocalTarget(tiny_target, kv_pool=layout != "copied-caches")
    batched.packed = layout == "packed"
    alone = LocalTarget(tiny_target, kv_pool=False)
    drafters = [ModelDrafter(tiny_draft, 96), TreeDrafter(tiny_draft, 96, widths=(3, 2, 1)),
                PromptLookupDrafter(max_candidates=3), None, ModelDrafter(tiny_draft, 96),
                ModelDrafter(tiny_draft, 96)]
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + 2 * i] for i in range(len(drafters))]
    prompts[-1] = PROMPTS[0][:1]  # a one-token prompt: nothing cached at the first step
    for i, prompt in enumerate(prompts):
        batched.prefill(f"s{i}", prompt)
        alone.prefill(f"s{i}", prompt)
    generator = torch.Generator().manual_seed(0)
    for step in range(12):
        requests = []
        for i, drafter in enumerate(drafters):
            context = batched.committed(f"s{i}")
            k = SHORT + 3 if i == len(drafters) - 1 else 2 + (step + i) % 4
            tree = DraftTree() if drafter is None else drafter.propose(context, k, sampling, generator)
            requests.append(VerifyRequest(f"s{i}", tree, sampling, seed=1000 * step + i))
        verdicts = verify_batch(batched, requests)
        for request, verdict in zip(requests, verdicts):
            lone = alone.verify(request.session, request.tree, request.sampling, request.seed)
            assert (verdict.accepted_path, verdict.bonus_token) == (lone.accepted_path, lone.bonus_token)
            assert batched.committed(request.session) == alone.committed(request.session)


def test_a_batch_of_one_token_prompts(tiny_target):
    """Nothing cached in any row (every prompt is one token): the batch starts from an empty cache."""
    batched, alone = LocalTarget(tiny_target), LocalTarget(tiny_target)
    for i in range(3):
        batched.prefill(f"s{i}", [5 + i])
        alone.prefill(f"s{i}", [5 + i])
    requests = [VerifyRequest(f"s{i}", DraftTree.chain([7, 8][:i]), SamplingParams(), 0) for i in range(3)]
    for request, verdict in zip(requests, verify_batch(batched, requests)):
        lone = alone.verify(request.session, request.tree, request.sampling, request.seed)
        assert (verdict.accepted_path, verdict.bonus_token) == (lone.accepted_path, lone.bonus_token)


def test_a_failing_row_rolls_back_only_its_own_session(tiny_target):
    target = LocalTarget(tiny_target)
    for name in ("good", "bad"):
        target.prefill(name, PROMPTS[0])
    requests = [VerifyRequest("good", DraftTree.chain([1, 2]), SamplingParams(), 0),
                VerifyRequest("bad", DraftTree.chain([1, 5000]), SamplingParams(), 0),  # out of vocabulary
                VerifyRequest("nobody", DraftTree.chain([1]), SamplingParams(), 0)]
    good, bad, unknown = verify_batch(target, requests)
    assert good.bonus_token >= 0 and isinstance(bad, Exception) and isinstance(unknown, Exception)
    assert target.committed("bad") == PROMPTS[0]
    fresh = LocalTarget(tiny_target)
    fresh.prefill("bad", PROMPTS[0])
    expected = fresh.verify("bad", DraftTree.chain([1, 2]), SamplingParams(), 0)
    assert target.verify("bad", DraftTree.chain([1, 2]), SamplingParams(), 0).bonus_token == expected.bonus_token


def test_a_row_failing_after_the_forward_rolls_back_alone(tiny_target, monkeypatch):
    from specbench.decode import batch

    real = batch.verify

    def failing(tree, logits, sampling, generator, choices=None, position=None):
        if 77 in tree.tokens:
            raise RuntimeError("this row fails after the forward")
        return real(tree, logits, sampling, generator, choices, position)

    target, reference = LocalTarget(tiny_target), LocalTarget(tiny_target)
    for name in ("a", "b"):
        target.prefill(name, PROMPTS[1])
        reference.prefill(name, PROMPTS[1])
    monkeypatch.setattr(batch, "verify", failing)
    ok, failed = verify_batch(target, [VerifyRequest("a", DraftTree.chain([3, 4]), SamplingParams(), 0),
                                       VerifyRequest("b", DraftTree.chain([77, 4]), SamplingParams(), 0)])
    assert isinstance(failed, RuntimeError) and target.committed("b") == PROMPTS[1]
    monkeypatch.setattr(batch, "verify", real)
    for name in ("a", "b"):  # both sessions go on exactly as sessions that never saw the failure
        reference.verify("a", DraftTree.chain([3, 4]), SamplingParams(), 0) if name == "a" else None
        got = target.verify(name, DraftTree.chain([5]), SamplingParams(), 1)
        expected = reference.verify(name, DraftTree.chain([5]), SamplingParams(), 1)
        assert (got.accepted_path, got.bonus_token) == (expected.accepted_path, expected.bonus_token)
        assert target.committed(name) == reference.committed(name)


@pytest.mark.parametrize("chunk", [5, SHORT + 3], ids=["short-chunks", "long-chunks"])
def test_prefill_chunks_ride_in_batched_verifies(tiny_target, tiny_draft, chunk):
    """A long prompt fed chunk by chunk inside other sessions' batched verifies (packed): every verdict
    is the lone one, and the prefilled session then decodes exactly as one prefilled alone."""
    batched, alone = LocalTarget(tiny_target), LocalTarget(tiny_target, kv_pool=False)
    assert batched.packed
    for i in range(3):
        batched.prefill(f"s{i}", PROMPTS[i])
        alone.prefill(f"s{i}", PROMPTS[i])
    long_prompt = [int(t) for t in torch.randint(3, 96, (60,), generator=torch.Generator().manual_seed(1))]
    job = batched.prefill_job("late", long_prompt)
    alone.prefill("late", long_prompt)
    drafter, greedy, generator = ModelDrafter(tiny_draft, 96), SamplingParams(), torch.Generator().manual_seed(0)
    rides = 0
    while job.remaining:
        requests = [VerifyRequest(f"s{i}", drafter.propose(alone.committed(f"s{i}"), 1 + i, greedy, generator),
                                  greedy, rides) for i in range(3)]
        for request, verdict in zip(requests, verify_batch(batched, requests, prefills=[(job, chunk)])):
            lone = alone.verify(request.session, request.tree, greedy, rides)
            assert (verdict.accepted_path, verdict.bonus_token) == (lone.accepted_path, lone.bonus_token)
        rides += 1
    assert rides == -(-(len(long_prompt) - 1) // chunk)
    assert "late" not in batched.sessions and job.advance(chunk)  # the last chunk in: the session goes live
    for step in range(4):
        tree = drafter.propose(alone.committed("late"), 3, greedy, generator)
        got, want = batched.verify("late", tree, greedy, step), alone.verify("late", tree, greedy, step)
        assert (got.accepted_path, got.bonus_token) == (want.accepted_path, want.bonus_token)
    assert batched.committed("late") == alone.committed("late")
