"""A method registered in one file, as a user would add one: draft k copies of the last token."""
from specbench.methods import Method, register
from specbench.types import DraftTree, SparseDist


class RepeatLast:
    name = "repeat-last"

    def propose(self, context, k, sampling, draws, max_depth=None):
        tokens = [context[-1]] * min(k, max_depth or k)
        return DraftTree.chain(tokens, [SparseDist((t,), (1.0,)) for t in tokens])  # deterministic: point-mass q


register(Method("repeat-last", "chain", lambda source: RepeatLast(), plannable=True))
