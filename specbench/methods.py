"""The method table: every decoding method by name, read by `run`, the CLI, the worker and the plan layer.

A method says how to build its drafter and what it is: its kind (`none`, `chain` or `tree`: how the
predictor prices it), whether a step planner may choose its K, whether proactive drafting applies,
and whether it runs wholly on a worker. Adding a method is one `register(Method(...))` call in
one file; `run`, `specbench run` and the records pick it up from here. Drafter classes are imported
only when a method is built, so the table itself loads without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from specbench.models.spec import ModelSpec
from specbench.registry import Registry
from specbench.types import CROSS_TOKENIZER_RULES, STOP_BELOW, SpecbenchError, default_rule

KINDS = ("none", "chain", "tree")
CROSS_TOKENIZER = CROSS_TOKENIZER_RULES + ("off",)  # off: refuse a draft with another tokenizer


@dataclass(frozen=True)
class TreeShape:
    """Tree drafting settings: `k` is the node budget; widths per depth make a fixed tree."""

    widths: tuple[int, ...] = (4, 2, 2, 1)
    max_depth: int = 6
    beam: int = 4
    branch: int = 4
    lookup_candidates: int = 4
    prune: bool = True  # dynamic trees: skip levels no node of which could be kept (same tree, fewer forwards)


@dataclass(frozen=True)
class DraftSource:
    """What a method may build its drafter from: the target (and its weights when it runs in this
    process), a draft model, and the options that shape drafters."""

    target: Any  # a Target: vocab_size is what drafters need
    target_model: Optional[Any] = None  # LoadedModel of an in-process target
    draft: Optional[Union[str, ModelSpec, Any]] = None  # catalog name, ModelSpec or LoadedModel
    dtype: str = "float32"
    self_draft_layers: Optional[int] = None
    substitute_quantization: str = "8bit"
    tree: TreeShape = TreeShape()
    cross_tokenizer: str = "auto"  # a draft with another tokenizer: auto | text | shared-vocab | off (refuse it)
    # model drafts (chains, trees, self-draft views) run fixed-shape steps (decode/fast_forward.py); None: on CUDA
    fast: bool | str | None = None
    suffix: Any = None  # SuffixSettings: suffix decoding's knobs and where its cache is shared; None: the defaults
    # chain-confident: a chain ends after a token its draft gave less than this probability (K is then a cap)
    stop_below: float = STOP_BELOW

    def __post_init__(self):
        from specbench.decode.suffix_drafter import as_settings

        object.__setattr__(self, "suffix", as_settings(self.suffix))
        if self.cross_tokenizer not in CROSS_TOKENIZER:
            raise SpecbenchError(f"cross_tokenizer must be one of {CROSS_TOKENIZER}, got {self.cross_tokenizer!r}")

    def draft_model(self, method: str):
        """The draft model, loaded."""
        from specbench.models.loading import as_loaded

        if self.draft is None:
            raise SpecbenchError(f"method {method!r} needs a draft model: pass draft=...")
        return as_loaded(self.draft, self.dtype)

    def model_drafter(self, method: str, tree: Optional[dict] = None, stop_below: float = 0.0):
        """A drafter over the draft model: in the target's own ids when both speak one vocabulary,
        else a cross-tokenizer drafter (unless `cross_tokenizer` is 'off'). `tree` holds TreeDrafter
        settings for tree methods; `stop_below` ends a chain at an unsure token (ModelDrafter)."""
        from specbench.decode.drafters import ModelDrafter
        from specbench.decode.tree_drafters import TreeDrafter
        from specbench.models.loading import VocabMismatchError, same_vocabulary

        draft = self.draft_model(method)
        target_tokenizer = self.target_model.tokenizer if self.target_model is not None else self.target.tokenizer
        name = f"{method}:{draft.spec.label}"
        try:
            same_vocabulary(draft, self.target_model, target_tokenizer, self.target.vocab_size)
        except VocabMismatchError as mismatch:
            if self.cross_tokenizer == "off" or draft.tokenizer is None or target_tokenizer is None:
                raise VocabMismatchError(f"{mismatch}; a draft with another tokenizer is translated through "
                                         f"text when both tokenizers are known"
                                         + (" and cross_tokenizer is not 'off'" if self.cross_tokenizer == "off"
                                            else "")) from None
            from specbench.decode.cross_drafters import CrossTokenizerDrafter

            # its own ids run ~1.1-1.2 per target token, so its static cache is as long as its own context
            own_context = getattr(draft.model.config, "max_position_embeddings", None)
            return CrossTokenizerDrafter(draft, target_tokenizer, self.target.vocab_size, rule=self.cross_tokenizer,
                                         tree=tree, name=f"{name}~cross", stop_below=stop_below,
                                         fast=None if tree else self.fast_forward(draft, own_context))
        if tree is not None:
            return TreeDrafter(draft, self.target.vocab_size, name=name, fast=self.fast_forward(draft), **tree)
        return ModelDrafter(draft, self.target.vocab_size, name=name, fast=self.fast_forward(draft),
                            stop_below=stop_below)

    def fast_forward(self, draft, context: Optional[int] = None):
        """The draft's fixed-shape forward when `fast` asks for one, as long as `context` (default: the
        target's, since a same-vocabulary draft follows the target's tokens)."""
        from specbench.decode.fast_forward import FastForward, chosen_backend, fast_capacity

        backend = chosen_backend(self.fast, draft.model)
        if not backend:
            return None
        context = (context or getattr(self.target, "max_context", None)
                   or getattr(draft.model.config, "max_position_embeddings", None))
        return FastForward(draft.model, fast_capacity(context, None), backend)

    def own_weights(self, method: str):
        if self.target_model is None:
            raise SpecbenchError(f"method {method!r} drafts from the target's own weights, so it needs a "
                                 f"target in this process (a name, ModelSpec, LoadedModel or LocalTarget)")
        return self.target_model


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # none | chain | tree
    build: Optional[Callable[[DraftSource], Any]] = None  # the drafter; None: no drafter here
    plannable: bool = False  # a step planner may choose its K per step
    drafts_ahead: bool = False  # proactive drafting applies: a chain from a draft model
    on_worker: bool = False  # runs wholly on a RemoteTarget's worker (only finished tokens travel)
    # an on-worker method whose worker drafts with a head (`heads/`): built there per request; None: a draft model
    worker_build: Optional[Callable[[DraftSource], Any]] = None
    lookup: bool = False  # drafts by looking up the context: no draft model, so nothing to profile or price
    reads_features: bool = False  # a draft head here: the target must run eager (fast steps expose no features)
    keeps_outputs: bool = False  # drafts from a cache of earlier outputs (suffix decoding), shared as configured
    # rejection sampling can verify its drafts; False for dynamic trees (which nodes they keep depends on the
    # tokens drawn), which sampled runs verify by sample-match
    rejection: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecbenchError(f"method {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")


METHODS: Registry[Method] = Registry("method")
register, get_method = METHODS.register, METHODS.lookup


def _chain(source: DraftSource):
    return source.model_drafter("chain")


def _chain_confident(source: DraftSource):
    return source.model_drafter("chain-confident", stop_below=source.stop_below)


def _tree(source: DraftSource):
    shape = source.tree
    return source.model_drafter("tree", tree=dict(max_depth=shape.max_depth, beam=shape.beam, branch=shape.branch,
                                                  prune=shape.prune))


def _fixed_tree(source: DraftSource):
    return source.model_drafter("fixed-tree", tree=dict(widths=source.tree.widths))


def _prompt_lookup(source: DraftSource):
    from specbench.decode.drafters import PromptLookupDrafter

    return PromptLookupDrafter()


def _prompt_lookup_tree(source: DraftSource):
    from specbench.decode.drafters import PromptLookupDrafter

    return PromptLookupDrafter(max_candidates=source.tree.lookup_candidates, name="prompt-lookup-tree")


def _suffix(source: DraftSource, tree: bool = False, key: tuple = ()):
    from specbench.decode.suffix_drafter import SuffixDrafter

    return SuffixDrafter(source.suffix, suffix_cache(source, key), tree=tree, name="suffix-tree" if tree else "suffix")


def suffix_cache(source: DraftSource, key: tuple = ()):
    """The process-wide cache of earlier outputs that suffix drafters built from `source` (and, on a worker, a
    tenant's `key`) share; None unless its settings keep one process-wide."""
    from specbench.decode.suffix_drafter import process_cache

    return process_cache(_target_key(source) + key, source.suffix) if source.suffix.cache == "process" else None


def _target_key(source: DraftSource) -> tuple:
    """What tells targets apart for a process-wide cache: outputs of one model never draft for another's, nor
    those of one dtype or kernels for another's (a bf16 copy beside the fp32 one, compared in one process, would
    otherwise draft each prompt from the other's output of it)."""
    loaded = source.target_model
    if loaded is not None:
        return (loaded.spec.label, loaded.spec.dtype, source.target.vocab_size)
    info = getattr(source.target, "info", None)
    if isinstance(info, dict):  # a worker's description: its model and dtype
        return (info.get("model"), info.get("dtype"), source.target.vocab_size)
    return (type(source.target).__name__, source.target.vocab_size)


def _self_draft(source: DraftSource):
    from specbench.decode.drafters import ModelDrafter
    from specbench.models.self_draft import truncated_view

    target = source.own_weights("self-draft")
    layers = source.self_draft_layers or max(1, target.model.config.num_hidden_layers // 4)
    view = truncated_view(target, layers)  # its own static cache when fast: the view's layers only
    return ModelDrafter(view, source.target.vocab_size, name=f"self-draft:{layers}", fast=source.fast_forward(view))


def _substitute(source: DraftSource):
    from specbench.decode.drafters import ModelDrafter
    from specbench.models.loading import load_model

    spec = source.own_weights("substitute").spec.quantized(source.substitute_quantization)
    return ModelDrafter(load_model(spec), source.target.vocab_size, name=f"substitute:{spec.label}")


def _suffix_eagle(source: DraftSource, tree: bool = False, key: tuple = ()):
    from specbench.decode.hybrid_drafter import HybridDrafter
    from specbench.heads.drafter import head_drafter

    head = head_drafter(source, tree=tree)  # first: a missing head is refused before any cache is made
    name = "suffix-eagle-tree" if tree else "suffix-eagle"
    return HybridDrafter(_suffix(source, tree=tree, key=key), head, source.suffix.hand_over, source.suffix.other_k,
                         name=name, catch_up=source.suffix.catch_up, trust=source.suffix.trust,
                         bench_below=source.suffix.bench_for(head=True))


def _suffix_chain(source: DraftSource, tree: bool = False, confident: bool = False):
    """Suffix decoding where its counts vouch, the draft model's chain elsewhere (with a tree: suffix decoding's
    tree or the chain, a chain being a tree too). The draft's cache syncs to whatever context it is handed,
    so the steps suffix decoding drafted cost it one catch-up forward when it next drafts. `confident`: the
    chain is chain-confident's, ended where the draft is unsure (`stop_below`) and capped by the step's k
    rather than `other_k`: its own confidence, not a fixed budget, says how far a model chain pays."""
    from specbench.decode.hybrid_drafter import HybridDrafter

    method = ("suffix-tree-chain" if tree else "suffix-chain") + ("-confident" if confident else "")
    # first: a missing draft is refused before any cache is made
    model = source.model_drafter(method, stop_below=source.stop_below if confident else 0.0)
    return HybridDrafter(_suffix(source, tree=tree), model, source.suffix.hand_over,
                         None if confident else source.suffix.other_k, name=method, catch_up=source.suffix.catch_up,
                         trust=source.suffix.trust, bench_below=source.suffix.bench_for(head=False))


def _eagle(source: DraftSource):
    from specbench.heads.drafter import head_drafter

    return head_drafter(source)


def _eagle_tree(source: DraftSource):
    from specbench.heads.drafter import head_drafter

    return head_drafter(source, tree=True)


for _method in (
    Method("target-only", "none"),
    Method("chain", "chain", _chain, plannable=True, drafts_ahead=True),
    # the same chain ended early where its draft is unsure (DraftSource.stop_below; Hugging Face's assisted
    # generation's default): K is a cap, as for suffix decoding
    Method("chain-confident", "chain", _chain_confident),
    Method("tree", "tree", _tree, rejection=False),
    Method("fixed-tree", "tree", _fixed_tree),
    Method("prompt-lookup", "chain", _prompt_lookup, plannable=True, lookup=True),
    Method("prompt-lookup-tree", "tree", _prompt_lookup_tree, lookup=True),
    Method("self-draft", "chain", _self_draft, plannable=True, drafts_ahead=True),
    Method("substitute", "chain", _substitute, plannable=True, drafts_ahead=True),
    # suffix decoding: the prompt's, and earlier outputs', continuations weighted by their counts; k is a cap
    Method("suffix", "chain", _suffix, lookup=True, keeps_outputs=True),
    Method("suffix-tree", "tree", lambda source: _suffix(source, tree=True), lookup=True, keeps_outputs=True),
    # suffix decoding on the worker: its cache there (per tenant unless the worker is told otherwise)
    Method("suffix-server", "chain", on_worker=True, lookup=True, keeps_outputs=True,
           worker_build=lambda source, key=(): _suffix(source, key=key)),
    Method("suffix-tree-server", "tree", on_worker=True, lookup=True, keeps_outputs=True,
           worker_build=lambda source, key=(): _suffix(source, tree=True, key=key)),
    Method("eagle", "chain", _eagle, reads_features=True),  # a draft head over the target's hidden states (heads/)
    Method("eagle-tree", "tree", _eagle_tree, reads_features=True, rejection=False),  # its EAGLE-2 dynamic tree
    # suffix decoding where its counts vouch for a continuation (SuffixSettings.hand_over), the head elsewhere
    Method("suffix-eagle", "chain", _suffix_eagle, reads_features=True, keeps_outputs=True),
    Method("suffix-eagle-tree", "tree", lambda source: _suffix_eagle(source, tree=True), reads_features=True,
           keeps_outputs=True, rejection=False),
    # the same with a draft model in place of the head: the first turn's new text to the model, repeats to suffix
    Method("suffix-chain", "chain", _suffix_chain, keeps_outputs=True),
    Method("suffix-tree-chain", "tree", lambda source: _suffix_chain(source, tree=True), keeps_outputs=True),
    # ... with chain-confident's chain: as long as the draft stays sure (first turns and open questions)
    Method("suffix-tree-chain-confident", "tree", lambda source: _suffix_chain(source, tree=True, confident=True),
           keeps_outputs=True),
    Method("server-only", "chain", on_worker=True),  # AutoDraft's Server-Only: the worker drafts too
    Method("server-only-ar", "none", on_worker=True),  # AutoDraft's Server-Only-AR
    # a draft head on the worker (the server-side placement): only finished tokens travel, no features
    Method("eagle-server", "chain", on_worker=True, worker_build=lambda source, key=(): _eagle(source)),
    Method("eagle-tree-server", "tree", on_worker=True, worker_build=lambda source, key=(): _eagle_tree(source),
           rejection=False),
    # the hybrid on the worker: its head there, its suffix cache the worker's (per tenant unless told otherwise)
    Method("suffix-eagle-server", "chain", on_worker=True, keeps_outputs=True,
           worker_build=lambda source, key=(): _suffix_eagle(source, key=key)),
    Method("suffix-eagle-tree-server", "tree", on_worker=True, keeps_outputs=True,
           worker_build=lambda source, key=(): _suffix_eagle(source, tree=True, key=key), rejection=False),
    # the worker's router (`specbench worker --router FILE`) picks each prompt's worker method and K
    Method("auto-server", "chain", on_worker=True, keeps_outputs=True),  # it may route to suffix decoding
):
    register(_method)


@dataclass(frozen=True)
class MethodChoice:
    """One method of a run as asked: "chain", "chain:3" (its own K) or "chain:3@smollm2-135m" (its own draft:
    a name in run's `drafts=`, else a catalog name, Hugging Face id or path), so one call can compare drafts."""

    name: str  # the method table's
    k: int
    draft: Optional[str] = None

    @property
    def label(self) -> str:
        """How its records name it (their `method`): the method, and its own draft after "@"."""
        return f"{self.name}@{self.draft}" if self.draft else self.name


def parse_methods(asked, k: int) -> list[MethodChoice]:
    """Each "method[:K][@draft]" string as a MethodChoice (K defaults to `k`), checked against the method table;
    one label given twice is refused (its rows and outputs would mix)."""
    import numbers

    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise SpecbenchError(f"k must be a whole number of draft tokens (a tree's node budget), got {k!r}")
    found: list[MethodChoice] = []
    for given in asked:
        head, at, draft = str(given).partition("@")
        name, _, own = head.partition(":")
        if own and not own.isdigit():
            raise SpecbenchError(f"method {given!r}: K after ':' must be a whole number")
        if at and not draft:
            raise SpecbenchError(f"method {given!r}: name a draft after '@' (a model, or a key of drafts=)")
        choice = MethodChoice(name, int(own) if own else int(k), draft or None)
        if name != "auto":
            method = get_method(name)  # an unknown method is refused by name, with the list
            if draft and (method.kind == "none" or method.lookup):
                raise SpecbenchError(f"method {given!r}: {name} drafts with no model, so it takes no '@draft'")
        elif draft:
            raise SpecbenchError(f"method {given!r}: auto's candidates carry their own drafts (the router's)")
        if any(other.label == choice.label for other in found):
            raise SpecbenchError(f"method {choice.label!r} is given twice ({given!r}): its rows and outputs would "
                                 f"mix; run each K of one method in its own call")
        found.append(choice)
    return found


def method_of(label: str) -> str:
    """The method-table name in a records' `method` label: "chain@smollm2-135m+planner" -> "chain"."""
    return label.split("@")[0].split("+")[0]


def sampled_rule(temperature: float, names=()) -> str:
    """The rule of a run of these methods that names none: greedy at temperature 0; else rejection (exact,
    and it accepts the most of a draft model's drafts) unless one of them drafts what rejection cannot
    verify (a dynamic tree) or is routed (`auto`: its choices may be), then sample-match for all, so that
    their outputs stay comparable. Example: ("chain", "fixed-tree") at 0.8 -> rejection; ("chain", "tree")
    -> sample-match."""
    bare = [method_of(name.split(":")[0]) for name in names]
    if temperature and any(name == "auto" or not get_method(name).rejection for name in bare):
        return "sample-match"
    return default_rule(temperature)


def lookup_method(kind: str) -> str:
    """The method of `kind` that drafts by lookup (prompt lookup's chains or trees): how a reference of
    "prompt-lookup" drafting is recorded."""
    return next(name for name, method in METHODS.items() if method.kind == kind and method.lookup)


def kind_method(kind: str) -> str:
    """The plain method of a kind, the first registered of it: `target-only`, `chain`, `tree`. The plan
    layer prices a measured method as the plain method of its kind (prompt lookup as a chain)."""
    return next(name for name, method in METHODS.items() if method.kind == kind)


def make_drafter(name: str, source: DraftSource):
    """The drafter method `name` uses with `source`; None for methods without one."""
    method = get_method(name)
    return method.build(source) if method.build else None


def check_runnable(method: Method, target, planner) -> None:
    """Refuse, by name, a method its target or step planner cannot run: a worker's method without a worker, a
    planner beside a method whose steps it cannot price, a planner built for a target here beside a worker."""
    remote = getattr(target, "generate_on_worker", None) is not None
    if method.on_worker and not remote:
        raise SpecbenchError(f"method {method.name!r} runs on a worker: pass target=RemoteTarget(...)")
    if planner is not None and not (method.plannable or method.kind == "none" or method.on_worker):
        plannable = [m.name for m in METHODS.values() if m.plannable]
        raise SpecbenchError(f"a step planner chooses chain lengths; method {method.name!r} is not a chain "
                             f"method (plannable: {plannable})")
    if method.plannable and planner is not None and (getattr(planner, "draft", True) is None) != method.lookup:
        raise SpecbenchError(f"this planner was built for {planner.reference.draft!r} drafting; method "
                             f"{method.name!r} drafts otherwise (a planner prices its own drafting)")
    if method.plannable and planner is not None and getattr(planner, "where", "remote") == "local" and remote:
        raise SpecbenchError("this planner prices a target here (where='local'), and the target is a worker: build "
                             "it with where='remote', so it follows the network time and the worker's batch")
