"""Drafting with a head from the target's features: chains, each token drawn from the q it reports.

The drafter is bound to the target's session it drafts for (`bind`, called by the loop, asks the
target to keep that session's features), reads the features of the committed positions, feeds the
head those it has not seen, then drafts past them with its own outputs as features. Positions
drafted past the features are dropped at the next step: the verify gives the real ones. The target
is a LocalTarget (features read in this process) or a RemoteTarget (the worker sends each step's rows:
the client-side placement; `eagle-server` drafts on the worker instead).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specbench.decode.kv import common_prefix
from specbench.decode.tree_drafters import TreeGrowth
from specbench.heads.model import EagleHead, HeadCache
from specbench.sampling.probs import draft_distribution, draft_draw
from specbench.sampling.streams import DraftDraws, draft_draws
from specbench.types import DraftTree, SamplingParams, SparseDist, SpecbenchError


class HeadDrafter:
    def __init__(self, head: EagleHead, target, name: str = "eagle"):
        self.head, self.target, self.name = head, target, name
        self.session: Optional[str] = None
        self.cache = HeadCache()
        self.fed: list[int] = []  # x_0 .. x_real: the tokens whose features the head has read
        self.last: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (hidden, logits) at the last real position
        self.target_ids = head.draft_to_target.tolist()  # draft id -> target id

    def bind(self, target, session: str) -> None:
        """Draft for `session` of `target` (the loop calls this before its prefill, so its features are kept)."""
        if target is not self.target:
            raise SpecbenchError("a head drafts from the target it was attached to; this loop runs another")
        target.keep_features(session, self.head.config.layer_ids)
        self.session, self.cache, self.fed, self.last = session, HeadCache(), [], None

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                draws: DraftDraws | torch.Generator, max_depth: Optional[int] = None) -> DraftTree:
        if k < 1:
            raise SpecbenchError(f"draft budget must be >= 1, got {k}")
        k = k if max_depth is None else min(k, max_depth)
        draws, context = draft_draws(draws), list(context)
        if not self._sync(context):
            return DraftTree()
        hidden, logits = self.last
        tokens, dists = [], []
        position = len(context) - 1  # the head position that reads the first drafted token
        draw = draft_draw(sampling)
        for index in range(k):
            dist = self._distribution(logits, sampling)
            tokens.append(draw(dist, draws.at(len(context) + index)))
            dists.append(dist)
            if index + 1 < k:
                hidden, logits = self._feed([tokens[-1]], hidden[None], position + index)
                hidden, logits = hidden[-1], logits[-1]
        return DraftTree.chain(tokens, dists)

    def _distribution(self, logits: torch.Tensor, sampling: SamplingParams) -> SparseDist:
        """q over the target's ids from draft-vocabulary logits: processed over the draft vocabulary and
        its ids mapped (ids outside it have probability zero either way), without a full-vocabulary pass per token."""
        dist = draft_distribution(logits.float().cpu(), sampling)
        return SparseDist(tuple(self.target_ids[i] for i in dist.ids), dist.probs)

    @torch.inference_mode()
    def _feed(self, tokens: list[int], features: torch.Tensor, start: int):
        device = self.head.lm_head.weight.device
        ids = torch.tensor(tokens, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)
        return self.head(ids, features, positions, self.cache)

    @torch.inference_mode()
    def _sync(self, context: list[int]) -> bool:
        """Feed the head every committed position it has not read (position t: token t + 1, feature t);
        False when there is none to draft from (a one-token prompt)."""
        if self.session is None:
            raise SpecbenchError("a head drafter is bound to a session before it drafts (the loop's bind)")
        rows = self.target.features(self.session)
        real = max(0, min(len(self.fed), common_prefix(self.fed, context)) - 1)  # head positions still valid
        self.cache.keep(real)
        self.fed = self.fed[:real + 1] if real else []
        new = len(context) - 1 - real
        if new > 0:
            if len(rows) < len(context) - 1:
                raise SpecbenchError(f"the target kept features for {len(rows)} positions of a context of "
                                     f"{len(context)}: it was prefilled before the head's tap was attached")
            weight = self.head.lm_head.weight
            features = self.head.fuse(torch.stack(rows[real:len(context) - 1]).to(weight.device, weight.dtype))
            hidden, logits = self._feed(context[real + 1:], features, real)
            self.last = (hidden[-1], logits[-1])
            self.fed = list(context)
        elif self.cache.length:
            self.cache.keep(len(context) - 1)
        return self.last is not None and len(context) > 1


class HeadTreeDrafter(TreeGrowth, HeadDrafter):
    """EAGLE-2's dynamic tree from a head: each level expands the nodes of highest cumulative draft
    probability (`TreeGrowth`), the head reading each node's token with its parent's output as the
    feature, attending to the verified positions, the node's ancestors and itself."""

    def __init__(self, head: EagleHead, target, name: str = "eagle-tree", widths=None, max_depth: int = 6,
                 beam: int = 4, branch: int = 4, prune: bool = True):
        HeadDrafter.__init__(self, head, target, name=name)
        self._set_shape(widths, max_depth, beam, branch, prune)
        self.outputs: dict[int, torch.Tensor] = {}  # node -> the head's output there (-1: the last verified position)

    _distribution = HeadDrafter._distribution  # the head's draft vocabulary, not TreeGrowth's target-id logits

    def _root_logits(self, context: list[int]) -> Optional[torch.Tensor]:
        if not self._sync(context):
            return None
        self.outputs = {-1: self.last[0]}
        return self.last[1]

    @torch.inference_mode()
    def _forward_level(self, context, nodes, fed, expand) -> list[torch.Tensor]:
        real, count = len(context) - 1, len(expand)
        visible = torch.zeros(count, self.cache.length + count, dtype=torch.bool)
        visible[:, :real] = True
        column = {node: real + i for i, node in enumerate(fed)}
        for row, node in enumerate(expand):
            visible[row, self.cache.length + row] = True
            ancestor = nodes[node].parent
            while ancestor >= 0:
                visible[row, column[ancestor]] = True
                ancestor = nodes[ancestor].parent
        device = self.head.lm_head.weight.device
        features = torch.stack([self.outputs[nodes[n].parent] for n in expand])
        positions = torch.tensor([real - 1 + nodes[n].depth for n in expand], device=device)
        hidden, logits = self.head(torch.tensor([nodes[n].token for n in expand], device=device), features, positions,
                                   self.cache, visible.to(device))
        self.outputs.update({node: hidden[row] for row, node in enumerate(expand)})
        return list(logits)

    def _forget_tree(self, context: list[int]) -> None:
        self.cache.keep(len(context) - 1)  # tree nodes are not a sequence: keep only the verified positions


def head_drafter(source, tree: bool = False) -> HeadDrafter:
    """The `eagle` method's drafter: the head `source.draft` names (a folder, a Hugging Face id, or an
    EagleHead), reading the features of `source.target`: in this process (a LocalTarget), or sent by its
    worker each step (a RemoteTarget: the head drafts here, the client-side placement)."""
    from specbench.heads.features import attach
    from specbench.heads.layouts import load_head

    remote = not hasattr(source.target, "sessions")
    if source.draft is None:
        raise SpecbenchError("method 'eagle' needs a draft head: pass draft=<folder or id of an EAGLE-3 head>")
    where = getattr(source.draft, "model", source.draft)  # a ModelSpec (the CLI's --draft) names a folder or id
    if isinstance(where, EagleHead):
        head = where
    else:
        head = load_head(where, source.target if remote else source.own_weights("eagle"))
    if not remote:
        attach(source.target, head.config.layer_ids)  # refused here (a fast target, another head's layers)
    name = f"eagle:{'head' if isinstance(where, EagleHead) else where}"
    if tree:
        shape = source.tree
        return HeadTreeDrafter(head, source.target, name=f"{name}~tree", max_depth=shape.max_depth, beam=shape.beam,
                               branch=shape.branch, prune=shape.prune)
    return HeadDrafter(head, source.target, name=name)
