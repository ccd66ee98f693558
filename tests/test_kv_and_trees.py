"""KV bookkeeping: tree attention equals per-path forwards; compaction keeps exactly the accepted path."""
import torch
from transformers import DynamicCache

from specbench.decode.kv import cached_length, keep_positions, tree_attention_mask
from specbench.decode.target import LocalTarget
from specbench.types import DraftTree, SamplingParams

TREE = DraftTree(tokens=(11, 12, 13, 14, 15, 16), parents=(-1, -1, 0, 0, 2, 1))


def path_to(tree, node):
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


@torch.no_grad()
def test_tree_attention_equals_each_root_to_leaf_path(tiny_target):
    model = tiny_target.model
    prompt = [3, 1, 4, 1, 5, 9]
    past = len(prompt) - 1
    cache = DynamicCache(config=model.config)
    model(torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
    depths = TREE.depths()
    positions = [past] + [past + d for d in depths]
    mask = tree_attention_mask(TREE.parents, 1, past, model.dtype, "cpu")
    tree_logits = model(torch.tensor([[prompt[-1], *TREE.tokens]]), past_key_values=cache,
                        position_ids=torch.tensor([positions]), attention_mask=mask, use_cache=True).logits[0]
    for node in range(len(TREE)):
        ids = prompt + [TREE.tokens[i] for i in path_to(TREE, node)]
        path_logits = model(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(tree_logits[1 + node], path_logits, atol=1e-4), node


def test_keep_positions_compacts_in_place():
    cache = DynamicCache()
    keys = torch.arange(10.0).view(1, 1, 10, 1)
    cache.update(keys, keys + 100, layer_idx=0)
    keep_positions(cache, [0, 1, 2, 5, 7])
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 5, 7]
    assert cache.layers[0].values.flatten().tolist() == [100, 101, 102, 105, 107]
    keep_positions(cache, [0, 1])
    assert cached_length(cache) == 2


def test_target_commits_only_the_accepted_tree_path(tiny_target):
    target = LocalTarget(tiny_target)
    prompt = [3, 1, 4, 1, 5, 9]
    target.prefill("s", prompt)
    greedy = LocalTarget(tiny_target)
    greedy.prefill("g", prompt)
    first = greedy.verify("g", DraftTree(), SamplingParams(), 0).bonus_token
    second = greedy.verify("g", DraftTree(), SamplingParams(), 0).bonus_token
    tree = DraftTree(tokens=((first + 1) % 96, first, second, 7), parents=(-1, -1, 1, 0))
    verdict = target.verify("s", tree, SamplingParams(), 0)
    assert verdict.accepted_path[:2] == (1, 2)
    assert target.committed("s") == prompt + [first, second, verdict.bonus_token]
    assert cached_length(target.sessions["s"].cache) == len(prompt) + 2
    # the compacted cache continues exactly like a fresh prefill of the same tokens
    fresh = LocalTarget(tiny_target)
    fresh.prefill("f", target.committed("s"))
    assert (target.verify("s", DraftTree(), SamplingParams(), 0).bonus_token
            == fresh.verify("f", DraftTree(), SamplingParams(), 0).bonus_token)


def test_dynamic_tree_pruning_saves_forwards_and_keeps_the_tree(tiny_target, tiny_draft):
    from specbench.decode.tree_drafters import TreeDrafter

    def counted(drafter):
        calls = []
        original = drafter._forward_level
        drafter._forward_level = lambda *a: calls.append(len(a[3])) or original(*a)
        return calls

    saved = 0
    for budget in (2, 4, 8, 16):
        for prompt in ([1, 2, 3, 4, 5], [40, 41, 42, 43], [5, 80, 3, 17]):
            pruned, plain = TreeDrafter(tiny_draft, 96, max_depth=6), TreeDrafter(tiny_draft, 96, max_depth=6, prune=False)
            pruned_calls, plain_calls = counted(pruned), counted(plain)
            a = pruned.propose(prompt, budget, SamplingParams(), torch.Generator())
            b = plain.propose(prompt, budget, SamplingParams(), torch.Generator())
            assert (a.tokens, a.parents) == (b.tokens, b.parents), (budget, prompt)
            assert sum(pruned_calls) <= sum(plain_calls)
            saved += sum(plain_calls) - sum(pruned_calls)
    assert saved > 0, "pruning never skipped a node: the test shows nothing"
