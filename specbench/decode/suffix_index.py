"""A bounded-depth suffix trie with counts: what suffix decoding drafts from.

Every substring of at most `depth` tokens of the indexed sequences is a path from the root, and each
node counts how often its path occurs. A context is matched by its trailing tokens; the continuations
below the match are weighted by how often each was seen (a child's count over its parent's), so a
proposal's path probability estimates the chance the target accepts it, and its length follows the
counts instead of a fixed K. Sequences are appended to a token at a time (a response as it is
generated) and removed whole (a shared cache evicting its oldest response).

Example: indexing [5, 6, 7, 5, 6, 8] and matching a context ending in (5, 6) finds two continuations,
7 and 8, each seen once under the two occurrences of (5, 6), so each has probability 1/2.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from specbench.types import SpecbenchError


class _Node:
    """A path's count; its children are None, the one child itself (most paths never branch, and a
    dict per node would triple the index's memory), or a dict by token."""

    __slots__ = ("count", "depth", "token", "children")

    def __init__(self, depth: int, token: int = -1):
        self.count = 0
        self.depth = depth
        self.token = token
        self.children: Union[None, _Node, dict[int, _Node]] = None

    def child(self, token: int) -> Optional["_Node"]:
        children = self.children
        if children is None:
            return None
        if type(children) is _Node:
            return children if children.token == token else None
        return children.get(token)

    def add(self, token: int) -> "_Node":
        child, children = _Node(self.depth + 1, token), self.children
        if children is None:
            self.children = child
        elif type(children) is _Node:
            self.children = {children.token: children, token: child}
        else:
            children[token] = child
        return child

    def drop(self, token: int) -> None:
        if type(self.children) is _Node:
            self.children = None
        else:
            del self.children[token]

    def all(self) -> list["_Node"]:
        children = self.children
        return [] if children is None else [children] if type(children) is _Node else list(children.values())

    def ranked(self) -> list[tuple[int, "_Node"]]:
        """Children, most seen first (ties: the smaller token id first, so proposals are deterministic)."""
        return [(child.token, child) for child in sorted(self.all(), key=lambda child: (-child.count, child.token))]


@dataclass(frozen=True)
class SuffixDraft:
    """A proposal: tokens with parents (-1: the context's last token), each token's estimated
    probability of being reached (its path's), their sum (`score`: expected accepted tokens) and how
    many trailing context tokens matched."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_length: int = 0
    score: float = field(default=0.0)


class SuffixIndex:
    """Counts of every substring of at most `depth` tokens over a set of sequences (see module doc)."""

    def __init__(self, depth: int = 24):
        if depth < 2:
            raise SpecbenchError(f"suffix index depth must be >= 2 (one token matched, one proposed), got {depth}")
        self.depth = depth
        self.root = _Node(0)
        self.nodes = 1
        self._sequences: dict[int, list[int]] = {}
        self._open: dict[int, list[_Node]] = {}  # per sequence: the nodes its last depth-1 suffixes end at

    def __contains__(self, sequence: int) -> bool:
        return sequence in self._sequences

    def tokens(self, sequence: int) -> int:
        return len(self._sequences[sequence])

    @property
    def total_tokens(self) -> int:
        return sum(len(tokens) for tokens in self._sequences.values())

    def extend(self, sequence: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to `sequence` (a new one starts empty): every new substring ending at them is counted."""
        stored = self._sequences.setdefault(sequence, [])
        active = self._open.setdefault(sequence, [])
        for token in tokens:
            token = int(token)
            stored.append(token)
            self.root.count += 1
            grown = []
            for node in [self.root] + active:
                child = node.child(token)
                if child is None:
                    child = node.add(token)
                    self.nodes += 1
                child.count += 1
                if child.depth < self.depth:
                    grown.append(child)
            self._open[sequence] = active = grown

    def remove(self, sequence: int) -> None:
        """Forget `sequence`: every count it added is taken back, and nodes no sequence reaches go."""
        tokens = self._sequences.pop(sequence)
        self._open.pop(sequence, None)
        for start in range(len(tokens)):
            node = self.root
            node.count -= 1
            for token in tokens[start:start + self.depth]:
                child = node.child(token)
                child.count -= 1
                if child.count == 0:
                    node.drop(token)
                    self.nodes -= _size(child)
                    break
                node = child

    def match(self, context: Sequence[int], length: int) -> Optional[_Node]:
        """The node of the context's last `length` tokens, None when that substring was never seen."""
        node = self.root
        for token in context[len(context) - length:]:
            node = node.child(int(token))
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], budget: int, *, tree: bool = False, min_prob: float = 0.1,
                  factor: float = 1.0, offset: float = 0.0) -> SuffixDraft:
        """The best proposal over every match length: at most min(budget, factor * match + offset)
        tokens, none whose path probability is under `min_prob`; a chain follows the most seen child,
        a tree takes the most probable paths first. Best: the highest score (expected accepted
        tokens); on a tie the longer match."""
        best = SuffixDraft()
        for length in range(1, min(len(context), self.depth - 1) + 1):
            node = self.match(context, length)
            if node is None:
                break
            limit = min(budget, int(length * factor + offset + 1e-6))
            if limit < 1:
                continue
            found = (_tree if tree else _chain)(node, limit, min_prob)
            if found[2] and sum(found[2]) >= best.score:
                best = SuffixDraft(*found, match_length=length, score=sum(found[2]))
        return best


def _chain(node: _Node, limit: int, min_prob: float) -> tuple[tuple, tuple, tuple]:
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < limit:
        children = node.all()
        if not children:
            break
        child = min(children, key=lambda child: (-child.count, child.token))  # ranked()'s first, without sorting
        token = child.token
        prob *= child.count / node.count
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        node = child
    return tuple(tokens), tuple(range(-1, len(tokens) - 1)), tuple(probs)


def _tree(node: _Node, limit: int, min_prob: float) -> tuple[tuple, tuple, tuple]:
    tokens, parents, probs = [], [], []
    frontier = []  # (-path probability, order pushed, token, node, parent index): most probable first
    order = 0
    for token, child in node.ranked():
        frontier.append((-child.count / node.count, order, token, child, -1))
        order += 1
    heapq.heapify(frontier)
    while frontier and len(tokens) < limit:
        negative, _, token, child, parent = heapq.heappop(frontier)
        if -negative < min_prob:
            break
        tokens.append(token)
        parents.append(parent)
        probs.append(-negative)
        for grandchild_token, grandchild in child.ranked():
            heapq.heappush(frontier, (negative * grandchild.count / child.count, order, grandchild_token,
                                      grandchild, len(tokens) - 1))
            order += 1
    return tuple(tokens), tuple(parents), tuple(probs)


def _size(node: _Node) -> int:
    """Nodes in the subtree under `node`, itself included."""
    size, stack = 0, [node]
    while stack:
        current = stack.pop()
        size += 1
        stack.extend(current.all())
    return size
