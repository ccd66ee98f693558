"""Tree drafters: fixed-shape trees and dynamic trees grown by cumulative draft probability.

Both expand the tree level by level, one draft forward per level over all nodes being expanded
(a tree attention mask on the draft's cache), so a depth-D tree costs D draft forwards, like a
chain of D tokens. Dynamic trees stop early once no frontier node can reach the kept set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from specbench.decode.drafters import ModelDrafter
from specbench.decode.kv import check_full_attention, crop_to
from specbench.models.loaded import LoadedModel
from specbench.sampling.probs import coupled_top, draft_distribution, sample_sparse
from specbench.sampling.streams import DraftDraws, draft_draws
from specbench.types import DraftTree, SamplingParams, SparseDist, SpecbenchError


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    log_prob: float  # cumulative log score of the path root..node: its draft probability (coupled: `_children`)
    q: SparseDist


class LeaderRate:
    """How often the target's draw was the coupled race's leader at a tree's first level (sample-match),
    counted from the context each step brings: the acceptance a coupled tree's first children can expect.
    Starts at 1/2 (one hit in two tries, a uniform prior). Example: the tree led with 17 after context c;
    the next context is c + [17, 4]: a hit (the target drew 17 there)."""

    def __init__(self):
        self.hits, self.tries, self.pending = 1, 2, None

    def observe(self, context: list[int]) -> None:
        if self.pending is None:
            return
        before, leader = self.pending
        self.pending = None
        if len(context) > len(before) and context[: len(before)] == before:
            self.tries += 1
            self.hits += context[len(before)] == leader

    def expect(self, context: list[int], leader: int) -> None:
        self.pending = (context, leader)

    @property
    def rate(self) -> float:
        return self.hits / self.tries


class TreeGrowth:
    """How a token tree grows, for any drafter that can give the root's logits (`_root_logits`), feed
    one level of nodes (`_forward_level`) and drop the tree afterwards (`_forget_tree`): a draft model
    (`TreeDrafter`) or a draft head (`heads/drafter.py`). Settings: `widths` (fixed shape) or `beam`,
    `branch`, `max_depth`, `prune` (dynamic), and `vocab_limit`."""

    def _set_shape(self, widths, max_depth: int, beam: int, branch: int, prune: bool) -> None:
        if widths is not None and (not widths or any(w < 1 for w in widths)):
            raise SpecbenchError(f"tree widths must be positive per depth, got {widths}")
        if max_depth < 1 or beam < 1 or branch < 1:
            raise SpecbenchError("max_depth, beam and branch must all be >= 1")
        self.widths = tuple(widths) if widths is not None else None
        self.max_depth = len(self.widths) if self.widths else max_depth
        self.beam, self.branch, self.prune = beam, branch, prune
        self.leaders = LeaderRate()

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                draws: DraftDraws | torch.Generator, max_depth: Optional[int] = None) -> DraftTree:
        """A tree of at most `k` nodes; the nodes of one level draw from that position's generator."""
        budget, draws = k, draft_draws(draws)
        if budget < 1:
            raise SpecbenchError(f"tree node budget must be >= 1, got {budget}")
        if self.widths is None and sampling.effective_rule == "rejection":
            raise SpecbenchError("dynamic trees pick nodes by their drawn tokens, so rejection sampling would be "
                                 "biased on them: use rule='sample-match' (lossless) or a fixed-width tree")
        context = list(context)
        coupled = draws.coupled and not sampling.greedy
        if coupled:
            self.leaders.observe(context)
        root_logits = self._root_logits(context)
        if root_logits is None:  # nothing to draft from (a head before any feature)
            return DraftTree()
        nodes: list[_Node] = []
        frontier = [(-1, root_logits)]
        fed: list[int] = []
        depth_limit = min(self.max_depth, budget, max_depth or budget)
        try:
            for depth in range(1, depth_limit + 1):
                created, position = [], len(context) + depth - 1
                shared = None if coupled else draws.at(position)  # one stream through the level's parents
                for parent, logits in frontier:
                    # coupled: every parent races on the very E the target draws this position with
                    generator = draws.at(position) if coupled else shared
                    created += self._children(nodes, parent, depth, logits, sampling, generator, coupled)
                if depth == depth_limit or not created:
                    break
                expand = created if self.widths else self._worth_expanding(nodes, created, budget)
                if not expand:
                    break
                frontier = list(zip(expand, self._forward_level(context, nodes, fed, expand)))
                fed += expand
        finally:
            self._forget_tree(context)
        keep = self._select(nodes, budget)
        if coupled and nodes:
            self.leaders.expect(context, nodes[0].token)  # nodes[0]: the root's first child, the race's leader
        return self._as_tree(nodes, keep, sampling)

    def _distribution(self, logits: torch.Tensor, sampling: SamplingParams) -> SparseDist:
        """q over the target's ids from a level's logits (a head maps its draft vocabulary)."""
        return draft_distribution(logits[: self.vocab_limit], sampling)

    def _children(self, nodes, parent, depth, logits, sampling, generator, coupled) -> list[int]:
        """A node's children: draws from q (rejection), q's top tokens (greedy, uncoupled sample-match) or,
        coupled to the target's draws (sample-match), the leaders of the race the target runs there
        (`coupled_top`): the target's draw is its leader when q = p, where q's top tokens hold it only
        with probability p of them. A child's score, the chance it is the target's token, is q's top
        values under greedy; coupled, the r-th child scores a * [r = 1] + (1 - a) * (r-th largest q), a the
        leaders' measured rate (`LeaderRate`): a good draft's tree grows deep along its leaders."""
        width = self.widths[depth - 1] if self.widths else self.branch
        base = nodes[parent].log_prob if parent >= 0 else 0.0
        if sampling.effective_rule == "rejection":
            q = self._distribution(logits, sampling)
            tokens = [sample_sparse(q, generator) for _ in range(width)]
            weights = dict(zip(q.ids, q.probs))
            scores = [weights[token] for token in tokens]
        elif coupled:
            q = self._distribution(logits, replace(sampling, draft_top_k=max(width, sampling.draft_top_k)))
            tokens, trust = coupled_top(q, generator, width), self.leaders.rate
            scores = [trust * (rank == 0) + (1 - trust) * value for rank, value in enumerate(q.probs[: len(tokens)])]
        else:
            # rank by the draft's tempered distribution (temperature 1 under greedy decoding)
            ranking = SamplingParams(temperature=sampling.temperature or 1.0, top_k=sampling.top_k,
                                     top_p=sampling.top_p, rule="sample-match", draft_top_k=max(width, 1))
            q = self._distribution(logits, ranking)
            tokens = list(q.ids[:width])
            scores = list(q.probs[: len(tokens)])
        created = []
        for token, score in zip(tokens, scores):
            nodes.append(_Node(token, parent, depth, base + math.log(max(score, 1e-30)), q))
            created.append(len(nodes) - 1)
        return created

    def _worth_expanding(self, nodes, created, budget) -> list[int]:
        """The `beam` best new nodes, minus those whose children could never be kept.

        A child scores at most its parent's cumulative log-probability and is deeper than every
        node so far (so it loses ties), while the cut-off for the final `budget` nodes only rises
        as nodes are added: a parent at or below the current budget-th best score has no child in
        the final tree. Skipping it (and stopping when none is left) saves draft forwards and
        leaves the selected tree exactly as it would have been.
        """
        best = sorted(created, key=lambda i: -nodes[i].log_prob)[: self.beam]
        if not self.prune or len(nodes) < budget:
            return best
        cutoff = sorted((n.log_prob for n in nodes), reverse=True)[budget - 1]
        return [i for i in best if nodes[i].log_prob > cutoff]

    def _select(self, nodes, budget) -> list[int]:
        if self.widths:
            # A prefix in creation (breadth-first) order: which nodes survive never depends on their tokens.
            return list(range(min(len(nodes), budget)))
        return self._best(nodes, budget)

    @staticmethod
    def _best(nodes, budget) -> list[int]:
        ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i].log_prob, nodes[i].depth, i))
        chosen = set()
        for index in ranked:
            if len(chosen) == budget:
                break
            if nodes[index].parent < 0 or nodes[index].parent in chosen:
                chosen.add(index)
        return sorted(chosen)

    @staticmethod
    def _as_tree(nodes, keep, sampling) -> DraftTree:
        remap = {old: new for new, old in enumerate(keep)}
        expected = sum(math.exp(nodes[i].log_prob) for i in keep)
        # Only rejection sampling reads q; greedy and sample-match trees travel without it.
        dists = tuple(nodes[i].q for i in keep) if sampling.effective_rule == "rejection" else None
        return DraftTree(tokens=tuple(nodes[i].token for i in keep),
                         parents=tuple(remap[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep),
                         draft_dists=dists, expected_accepted=expected)


class TreeDrafter(TreeGrowth, ModelDrafter):
    """A draft model proposing a token tree.

    Fixed shape (`widths=(4, 2, 1)`): every node at depth d gets widths[d] children. Under greedy
    and sample-match verification the children are the draft's top tokens; under rejection they
    are independent draws from q, which is what recursive rejection sampling needs to stay exact
    (the shape never depends on which tokens were drawn).

    Dynamic (`widths=None`): OPT-Tree / EAGLE-2 style. Each level expands the `beam` nodes with the
    highest cumulative draft probability, each into its top `branch` children; at the end the
    `budget` nodes with the highest cumulative probability are kept, which maximises the expected
    accepted length sum(P(path to node)) under the draft's own model. Ancestors always score at
    least as high as their descendants, so the kept set is a tree. Example: budget 3, root
    children a (.6) and b (.3), a's children c (.5 -> .3) and d (.4 -> .24): keeps a, b, c (ties
    favour the shallower node). Verify it with greedy or sample-match: the selection depends on
    the tokens drawn, so multi-draft rejection would not be exact on it.
    """

    def __init__(self, draft: LoadedModel, target_vocab_size: int, widths: Optional[Sequence[int]] = None,
                 max_depth: int = 6, beam: int = 4, branch: int = 4, name: str = "tree", prune: bool = True,
                 fast=None):
        ModelDrafter.__init__(self, draft, target_vocab_size, name=name, fast=fast)
        check_full_attention(draft.model, f"drafting a tree with {draft.spec.label}")
        self._set_shape(widths, max_depth, beam, branch, prune)

    def _root_logits(self, context: list[int]) -> Optional[torch.Tensor]:
        return self._sync(context)

    def _forget_tree(self, context: list[int]) -> None:
        crop_to(self.cache, len(context))  # tree tokens are not a sequence: keep only the context
        self.cached_ids = list(context)

    @torch.inference_mode()
    def _forward_level(self, context, nodes, fed, expand) -> list[torch.Tensor]:
        """Feed `expand` nodes in one forward; each attends to the context, its fed ancestors and itself."""
        past = len(context) + len(fed)
        total = past + len(expand)
        dtype = self.model.dtype
        mask = torch.full((len(expand), total), torch.finfo(dtype).min, dtype=dtype)
        mask[:, : len(context)] = 0.0
        column = {node: len(context) + i for i, node in enumerate(fed)}
        for row, node in enumerate(expand):
            mask[row, past + row] = 0.0
            ancestor = nodes[node].parent
            while ancestor >= 0:
                mask[row, column[ancestor]] = 0.0
                ancestor = nodes[ancestor].parent
        device = self.model.get_input_embeddings().weight.device
        positions = torch.tensor([[len(context) - 1 + nodes[n].depth for n in expand]], device=device)
        tokens, mask = [nodes[n].token for n in expand], mask.view(1, 1, len(expand), total).to(device)
        if self.fast is not None:  # a level is a few nodes: a fixed-shape step like a verify's
            return list(self.fast(self.cache, tokens, positions, mask).float().cpu())
        output = self.model(input_ids=torch.tensor([tokens], device=device), past_key_values=self.cache,
                            position_ids=positions, attention_mask=mask, use_cache=True)
        return list(output.logits[0].float().cpu())
