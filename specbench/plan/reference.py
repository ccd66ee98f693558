"""Acceptance references: per-step acceptance of a draft/target pair on a dataset, what the predictor replays."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from statistics import mean

from specbench.methods import KINDS, get_method
from specbench.types import SpecbenchError

LOOKUP_DRAFT = "prompt-lookup"  # a reference's draft when prompt lookup drafted: no model, so no draft profile
SUFFIX_DRAFT = "suffix"  # suffix decoding's (its own context and earlier outputs): no model either
FREE_DRAFTS = (LOOKUP_DRAFT, SUFFIX_DRAFT)  # drafts that cost a step nothing and draft as much as they find
# suffix decoding's hybrids with a draft (`decode/hybrid_drafter.py`): priced from their own recorded steps only
HEAD_HYBRIDS = ("suffix-eagle", "suffix-eagle-tree")
HYBRIDS = HEAD_HYBRIDS + ("suffix-chain", "suffix-tree-chain", "suffix-tree-chain-confident")
TREE_OTHERS = ("suffix-eagle-tree",)  # hybrids whose draft proposes a tree (the others a chain)


@dataclass(frozen=True)
class AcceptanceReference:
    """Per-step acceptance traces of a draft/target pair on a dataset.

    `chain_accepts[i]` is how many leading tokens of a `max_chain`-token draft step i accepted;
    `tree_accepts[budget]` lists accepted depths per step of dynamic trees at that node budget.
    """

    draft: str
    target: str
    dataset: str
    rule: str = "greedy"
    temperature: float = 0.0
    max_chain: int = 8
    chain_accepts: tuple[int, ...] = ()
    tree_accepts: dict = field(default_factory=dict)
    tree_depth: dict = field(default_factory=dict)  # budget -> mean tree depth drafted
    tree_width: dict = field(default_factory=dict)  # budget -> draft tokens per draft forward (beam)
    # a draft with another tokenizer: the rule that carried it ("text" or "shared-vocab"), and the
    # draft-model tokens it produced per target token it proposed (its chains), which prices its drafting
    cross_tokenizer: str = ""
    draft_per_target: float = 1.0
    # prompt lookup: K -> share of its chain steps that found a K-token continuation to draft. The others
    # verify the bonus token alone (`chain_accepts` keeps the full steps only, what a planner needs), so
    # tokens per step and the verify's width are priced with this share; empty: every step drafts
    chain_hits: dict = field(default_factory=dict)
    # K -> ((drafted, accepted), ...) of every chain step of a run at K, each output's last steps (capped at
    # what remains) included: prompt lookup's and suffix decoding's as recorded, any draft's as a tune
    # replays it. A partial match verifies 1 + drafted tokens, not 1 or K + 1, and a capped step accepts
    # less, so where a K has them, its steps are priced as they are (tokens and widths), not by full steps
    steps_at_k: dict = field(default_factory=dict)
    steps_prompts: dict = field(default_factory=dict)  # K -> the prompt index of each step in steps_at_k[K]
    # budget -> ((nodes drafted, accepted), ...) of every step of a tree run of prompt lookup or suffix decoding, and
    # each step's prompt: they draft what they find, none on most steps of new text, so their trees are priced by
    # these steps (`tree_accepts` keeps full trees only, a model draft's every step); empty in older references
    tree_steps: dict = field(default_factory=dict)
    tree_steps_prompts: dict = field(default_factory=dict)
    # per-prompt rows: the prompt index of each chain step and of each tree step per budget, and each
    # prompt's family (e.g. Spec-Bench's category); empty in references recorded before they were kept
    chain_prompts: tuple[int, ...] = ()
    tree_prompts: dict = field(default_factory=dict)
    prompt_families: tuple[str, ...] = ()
    # a draft head's feature row on the wire per committed position (layers x hidden, float16): what the
    # client-side placement receives each step for every position it commits; 0 for other drafts
    feature_bytes: int = 0
    # suffix decoding's hybrid with this draft (`hybrid_method`, e.g. `suffix-tree-chain`), as recorded at each suffix
    # budget: per step (1 where the draft drafted it, 0 where suffix decoding did; nodes drafted; accepted; depth),
    # and each step's prompt. Which drafter takes a step depends on the request's own record, so the hybrid is priced
    # from its own steps, not from the draft's and suffix decoding's references; `hybrid_settings` are the knobs
    # (`SuffixSettings` fields) it ran with, `hybrid_width` its draft's tree width (1: a chain)
    hybrid_method: str = ""
    hybrid_steps: dict = field(default_factory=dict)
    hybrid_prompts: dict = field(default_factory=dict)
    hybrid_settings: dict = field(default_factory=dict)
    hybrid_width: int = 1
    origin: str = field(default="", compare=False)  # "shipped" or "own", as for profiles

    def families(self) -> list[str]:
        return sorted(set(self.prompt_families))

    def for_family(self, family: str) -> "AcceptanceReference":
        """The reference over one family's prompts only, named "<dataset>/<family>": a planner and the
        explorer then show how a recommendation moves with the workload."""
        if family not in self.prompt_families:
            raise SpecbenchError(f"reference {self.draft} -> {self.target} on {self.dataset} has no family "
                                 f"{family!r}; its families: {self.families() or 'none recorded'}")
        mine = {i for i, f in enumerate(self.prompt_families) if f == family}
        chain = tuple(a for a, p in zip(self.chain_accepts, self.chain_prompts) if p in mine)
        trees, tree_prompts = _family_part(self.tree_accepts, self.tree_prompts, mine)
        # a run's every step, where each kept its prompt; without prompts (recorded before they were kept) the
        # whole set's steps would price every family alike, so the family is priced from its full steps alone
        runs, run_prompts = _family_part(self.steps_at_k, self.steps_prompts, mine)
        grown, grown_prompts = _family_part(self.tree_steps, self.tree_steps_prompts, mine)
        hybrid, hybrid_prompts = _family_part(self.hybrid_steps, self.hybrid_prompts, mine)
        return replace(self, dataset=f"{self.dataset}/{family}", chain_accepts=chain,
                       chain_prompts=tuple(p for p in self.chain_prompts if p in mine),
                       tree_accepts=trees, tree_prompts=tree_prompts, steps_at_k=runs, steps_prompts=run_prompts,
                       tree_steps=grown, tree_steps_prompts=grown_prompts, hybrid_steps=hybrid,
                       hybrid_prompts=hybrid_prompts,
                       tree_depth={b: v for b, v in self.tree_depth.items() if b in trees},
                       tree_width={b: v for b, v in self.tree_width.items() if b in trees})

    def hit_rate(self, k: int) -> float:
        """Share of chain steps at K that draft K tokens (1 for model drafts, which always do)."""
        if not self.chain_hits:
            return 1.0
        known = {int(key): float(value) for key, value in self.chain_hits.items()}
        return known.get(k, known.get(self.max_chain, min(known.values())))

    @property
    def has_chains(self) -> bool:
        """Whether chain points can be priced: full chain steps, or (drafting by lookup) steps that drafted."""
        return bool(self.chain_accepts) or any(d for steps in self.steps_at_k.values() for d, _ in steps)

    def steps_at(self, k: int) -> tuple:
        """(drafted, accepted) per step of a run at K: as recorded at K, else from the largest K recorded above
        it (a step asked for fewer drafts the first K of the same proposal: lookup's same match, a model's
        same argmaxes), else empty."""
        known = {int(size): steps for size, steps in self.steps_at_k.items()}
        if k in known:
            return tuple(tuple(step) for step in known[k])
        above = [size for size in known if size > k]
        return tuple((min(d, k), min(a, k)) for d, a in known[max(above)]) if above else ()

    def prompts_at(self, k: int) -> tuple:
        """The prompt index of each step of `steps_at(k)`, where kept (else empty)."""
        known = {int(size): owners for size, owners in self.steps_prompts.items()}
        if k in known:
            return tuple(known[k])
        above = [size for size in {int(size) for size in self.steps_at_k} if size > k]
        return tuple(known.get(max(above), ())) if above else ()

    def tree_steps_at(self, budget: int) -> tuple:
        """(nodes drafted, accepted) per step of a free draft's tree run at `budget`, as recorded; else empty."""
        return tuple(tuple(step) for step in (self.tree_steps.get(budget) or self.tree_steps.get(str(budget)) or ()))

    def prices_hybrid(self, method: str) -> bool:
        """Whether `method` is the hybrid recorded here, drafting on the client or on a worker (`-server`)."""
        return bool(self.hybrid_method) and method in (self.hybrid_method, f"{self.hybrid_method}-server")

    def hybrid_steps_at(self, budget: int) -> tuple[tuple, tuple]:
        """((by the draft, nodes, accepted, depth) per step, each step's prompt) of the hybrid's run at `budget`;
        the prompts empty where a step's prompt was not kept."""
        steps = self.hybrid_steps.get(budget) or self.hybrid_steps.get(str(budget)) or ()
        prompts = self.hybrid_prompts.get(budget) or self.hybrid_prompts.get(str(budget)) or ()
        return tuple(tuple(step) for step in steps), tuple(prompts)

    def full_acceptance(self, k: int) -> float:
        """Share of chain steps of length K whose every draft token was accepted."""
        return mean(a >= k for a in self.chain_accepts) if self.chain_accepts else 0.0

    def accepted(self, method: str, k: int) -> float:
        """Expected accepted draft tokens per step of `method` (a method of the table, or its kind)."""
        kind = method if method in KINDS else get_method(method).kind
        if kind == "none":
            return 0.0
        if kind == "chain":
            if not 1 <= k <= self.max_chain:
                raise SpecbenchError(f"reference chains were {self.max_chain} long; cannot predict K={k}")
            if not self.chain_accepts:
                raise SpecbenchError("reference has no chain steps")
            return mean(min(a, k) for a in self.chain_accepts)
        if kind == "tree":
            steps = self.tree_accepts.get(k) or self.tree_accepts.get(str(k))
            if not steps:
                measured = sorted(int(b) for b in self.tree_accepts)
                raise SpecbenchError(f"no measured tree steps at budget {k} (measured: {measured}); "
                                     f"record a reference at that budget rather than interpolate")
            return mean(steps)
        raise SpecbenchError(f"cannot predict method {method!r} of kind {kind!r}")


def _family_part(steps: dict, owners: dict, mine: set) -> tuple[dict, dict]:
    """`steps` (key -> a value per step) and `owners` (key -> each step's prompt) kept to the steps of the prompts in
    `mine`; a key left with none is dropped, and a key without owners keeps nothing."""
    kept = {key: [(step, p) for step, p in zip(values, owners.get(key, ())) if p in mine]
            for key, values in steps.items()}
    kept = {key: pairs for key, pairs in kept.items() if pairs}
    return ({key: tuple(step for step, _ in pairs) for key, pairs in kept.items()},
            {key: tuple(p for _, p in pairs) for key, pairs in kept.items()})
