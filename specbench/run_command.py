"""`specbench run`: methods side by side on prompts, and what the table alone does not say (the parsing is in
`cli.py`)."""
from __future__ import annotations

from specbench.types import SamplingParams, SpecbenchError


def run_command(args) -> int:
    """Run the methods on the prompts; print the summary and, beside target-only, why each paid or not and
    (greedy) whether every output is target-only's."""
    from specbench.api import divergences, run
    from specbench.decode.divergence import difference_lines
    from specbench.decode.metrics import summarize
    from specbench.decode.verdict import speed_verdicts
    from specbench.demo import DEMO_PROMPTS
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    if args.config:
        from specbench.tune.command import apply_config

        apply_config(args)
    target = ModelSpec(args.target, dtype=args.dtype, quantization=args.quant, kernels=args.kernels)
    draft = (ModelSpec(args.draft, dtype=args.dtype, quantization=args.draft_quant, kernels=args.kernels)
             if args.draft else None)
    sampling = SamplingParams(temperature=args.temperature, rule=args.rule)
    planner = None
    if args.plan:
        from specbench.plan.step_planner import planner_from_caches

        from specbench.methods import get_method
        from specbench.plan.predict import LOOKUP_DRAFT

        if draft is None and not any(get_method(m).lookup for m in args.method):  # no draft: a lookup's planner
            raise SpecbenchError("--plan chooses K per step for a draft/target pair or prompt lookup: pass --draft")
        planner = planner_from_caches(target.label, draft.label if draft else LOOKUP_DRAFT, cs=args.cs,
                                      max_k=args.k, draft_budget_mib=args.draft_budget_mib, dtype=args.dtype)
    loaded, prompts = load_model(target), args.prompt or DEMO_PROMPTS  # loaded once: the run and the check share it
    records = run(loaded, prompts, method=args.method, draft=draft, k=args.k,
                  max_new_tokens=args.max_new_tokens, sampling=sampling, dtype=args.dtype, planner=planner,
                  substitute_quantization=args.substitute_quant, cross_tokenizer=args.cross_tokenizer,
                  fast=args.fast, self_draft_layers=getattr(args, "self_draft_layers", None), router=_router(args),
                  suffix=suffix_settings(args))
    print(summarize(records).round(3).to_string(index=False))
    if "target-only" in args.method:  # why each method paid or not; greedy: whether each output is target-only's
        print("\n".join(speed_verdicts(records)))
        if sampling.greedy:
            print("\n".join(difference_lines(divergences(records, loaded, prompts), args.dtype)))
    if args.out:
        records.to_csv(args.out, index=False)
        print(f"per-step records: {args.out}")
    return 0


def suffix_settings(args):
    """`--suffix KEY=VALUE ...`: suffix decoding's settings for the suffix methods (and `auto`'s)."""
    if not args.suffix:
        return None
    from specbench.decode.suffix_drafter import SuffixSettings, suffix_options

    return SuffixSettings(**suffix_options(args.suffix))


def _router(args):
    if "auto" not in args.method:
        return None
    if not args.router:
        raise SpecbenchError("--method auto needs --router FILE (train one with `specbench route`)")
    from specbench.route.router import Router

    return Router.load(args.router)
