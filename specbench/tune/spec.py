"""What `specbench tune` is asked, checked before any work: the target, the candidate drafts, the
prompts and their split, where the target runs, the loads and the objective.

Why checked first: a tune runs for minutes; an unknown draft, an empty dataset, a budget too small
for anything or an unreachable worker must be refused by name before the first profile starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specbench.types import SpecbenchError

LOOKUP = "prompt-lookup"
SUFFIX = "suffix"  # suffix decoding: like prompt lookup, no draft model; its cache holds the prompts' own outputs
FREE = (LOOKUP, SUFFIX)  # candidates that draft from the context: nothing to load or profile
HEAD = "eagle:"  # a draft head over the target's hidden states: `eagle:<its folder>`
GOAL_ERROR = 0.08  # |predicted - measured| / measured tokens/s over which a point is flagged


@dataclass(frozen=True)
class Candidate:
    """One way to draft: `method` of the method table, with its draft model (or none) and options.
    `name` is how a report and a config file call it: a model name, `prompt-lookup`, `suffix`,
    `self-draft:N` (the target's first N layers), `substitute:Q` (the target quantized) or `eagle:PATH` (a draft
    head's folder, `specbench train-draft`'s or a published EAGLE-3 one)."""

    name: str
    method: str
    draft: Optional[str] = None  # a model (catalog name, Hugging Face id or path) for chain and tree; a head's folder
    self_draft_layers: Optional[int] = None
    quantization: str = "none"  # a substitute's


@dataclass(frozen=True)
class TuneSpec:
    target: str
    drafts: tuple[str, ...] = ("auto",)  # names as in Candidate, or "auto": every draft that fits
    prompts: str | tuple = "bench"  # a dataset name, a JSONL path, or the prompts themselves (texts or token ids)
    prompt_count: int = 40
    calibration_share: float = 0.5  # references on this share of the prompts; measurements on the rest
    endpoint: Optional[str] = None  # a worker's; None: the target runs here
    clients: tuple[int, ...] = (1,)
    objective: str = "total_cost"
    cs: float = 0.5
    chain_ks: tuple[int, ...] = (1, 2, 3, 4, 6)
    tree_budgets: tuple[int, ...] = ()
    max_new_tokens: int = 32
    measure_top: int = 1  # the predicted best points measured, besides each candidate's best
    measure_share: float = 0.18  # of an exhaustive sweep's measuring time: then the best measured point's neighbours
    budget_minutes: float = 15.0
    dtype: str = "float32"
    kernels: str = "default"  # the target's and model drafts' CPU linear kernels (`ModelSpec.kernels`)
    draft_budget_mib: Optional[float] = None
    repeats: int = 3  # profile repeats per grid point
    calibration: str = "runs"  # what calibrates the profiles: runs | speed | widths | per-point (tune/calibrate.py)
    seed: int = 0
    temperature: float = 0.0  # the serving temperature: acceptance recorded and points measured at it (0: greedy)
    rule: Optional[str] = None  # the sampled runs' rule; None: `methods.sampled_rule` over the methods a tune runs
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        """Refuse, naming the problem, what no amount of work could satisfy."""
        from specbench.plan.objectives import get_objective
        from specbench.plan.costs import check_cs

        from specbench.tune.calibrate import MODES

        get_objective(self.objective)
        check_cs(self.cs)
        if self.calibration not in MODES:
            raise SpecbenchError(f"calibration {self.calibration!r}: one of {MODES}")
        if not 0 < self.calibration_share < 1:
            raise SpecbenchError(f"calibration_share must be between 0 and 1, got {self.calibration_share}")
        if self.prompt_count < 2:
            raise SpecbenchError(f"tune needs at least 2 prompts (one to calibrate on, one held back), "
                                 f"got prompt_count={self.prompt_count}")
        if self.max_new_tokens < 1:
            raise SpecbenchError(f"max_new_tokens must be >= 1 (tokens each measured run generates), got "
                                 f"{self.max_new_tokens}")
        if not self.chain_ks or min(self.chain_ks) < 1:
            raise SpecbenchError(f"chain_ks must be K values >= 1, got {self.chain_ks}")
        if not self.clients or min(self.clients) < 1:
            raise SpecbenchError(f"clients must be counts >= 1, got {self.clients}")
        if any(n > 1 for n in self.clients) and self.endpoint is None:
            raise SpecbenchError("clients share a remote target: give a worker endpoint for client counts above 1")
        if not 0 <= self.measure_share <= 1:
            raise SpecbenchError(f"measure_share is a share of a sweep's measuring time, 0 to 1: got {self.measure_share}")
        self.sampling()  # a bad temperature or rule, or rejection over dynamic trees, refused here
        if self.budget_minutes < 1:
            raise SpecbenchError(f"a budget of {self.budget_minutes} minutes leaves no time to profile, record and "
                                 f"measure anything: give --budget-minutes 1 or more")

    def sampling(self):
        """How every run of the tune samples: None at temperature 0 (greedy). A sampled tune records
        acceptance and measures at the serving temperature, since a draft accepted greedily 3 tokens a
        step may accept 2 at 0.8, and a choice checked greedily says nothing of a sampled service."""
        from specbench.methods import sampled_rule
        from specbench.types import VERIFY_RULES, SamplingParams

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise SpecbenchError(f"temperature must be a number, got {self.temperature!r}")
        if self.rule is not None and self.rule not in VERIFY_RULES:
            raise SpecbenchError(f"rule {self.rule!r}: one of {VERIFY_RULES}")
        if not self.temperature:
            return None
        trees = ("tree",) if self.tree_budgets else ()  # a tune's trees are dynamic: sample-match verifies them
        rule = self.rule or sampled_rule(self.temperature, ("chain", *trees))
        if rule == "rejection" and trees:
            raise SpecbenchError("rule rejection cannot verify the dynamic trees tree_budgets asks for (a tree picks "
                                 "nodes by their drawn tokens): use rule sample-match, or no tree budgets")
        return SamplingParams(temperature=float(self.temperature), rule=rule)

    @property
    def verify_rule(self) -> str:
        sampling = self.sampling()
        return "greedy" if sampling is None else sampling.rule

    @property
    def sampling_tag(self) -> str:
        """What tells a sampled tune's references and points from a greedy one's in its folder."""
        return "" if self.sampling() is None else f" t={self.temperature:g} {self.verify_rule}"


def candidate(name: str, target_layers: Optional[int] = None) -> Candidate:
    """The candidate a name stands for (`self-draft:N`, `substitute:Q`, `prompt-lookup`, `suffix`, `eagle:PATH`,
    or a model)."""
    from specbench.models.spec import QUANTIZATIONS

    if name in FREE:
        return Candidate(name, name)
    if name.startswith(HEAD):
        folder = name[len(HEAD):]
        if not folder:
            raise SpecbenchError(f"candidate {name!r}: eagle takes a draft head's folder, e.g. eagle:heads/my-head")
        return Candidate(name, "eagle", draft=folder)
    if name.startswith("self-draft"):
        layers = name.partition(":")[2]
        if layers and not layers.isdigit():
            raise SpecbenchError(f"candidate {name!r}: self-draft takes a layer count, e.g. self-draft:8")
        count = int(layers) if layers else max(1, (target_layers or 4) // 4)
        return Candidate(f"self-draft:{count}", "self-draft", self_draft_layers=count)
    if name.startswith("substitute"):
        quantization = name.partition(":")[2] or "int8-dynamic"
        if quantization not in QUANTIZATIONS or quantization == "none":
            raise SpecbenchError(f"candidate {name!r}: substitute takes a quantization of {QUANTIZATIONS[1:]}")
        return Candidate(f"substitute:{quantization}", "substitute", quantization=quantization)
    return Candidate(name, "chain", draft=name)


def check_sampled_load(spec: TuneSpec, candidates) -> None:
    """Several clients of a model draft are measured by replaying its proposals recorded alone, and a
    replay carries no draft distributions: at a temperature only drafts from the context load a worker."""
    if spec.sampling() is None or max(spec.clients) == 1:
        return
    drafting = [c.name for c in candidates if c.method not in FREE]
    if drafting:
        raise SpecbenchError(f"at temperature {spec.temperature:g}, client counts above 1 can be measured for "
                             f"{' and '.join(FREE)} only (a model draft's load is measured by replaying its greedy "
                             f"proposals): drop {drafting} from the drafts, or plan for clients 1")


def split_prompts(rows: list, share: float) -> tuple[list, list]:
    """(calibration, held back): the first `share` of the prompts, at least one each side."""
    cut = min(len(rows) - 1, max(1, round(len(rows) * share)))
    return rows[:cut], rows[cut:]
