"""`specbench run`: methods side by side on prompts, and what the table alone does not say (the parsing is in
`cli.py`)."""
from __future__ import annotations

from specbench.types import SamplingParams, SpecbenchError

DEFAULT_TARGET = "smollm2-135m"


def run_command(args) -> int:
    """Run the methods on the prompts; print the summary and, beside target-only, why each paid or not and
    (greedy) whether every output is target-only's."""
    from specbench.api import divergences, run
    from specbench.decode.divergence import difference_lines
    from specbench.decode.metrics import summarize
    from specbench.decode.verdict import speed_verdicts
    from specbench.methods import parse_methods, sampled_rule
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    if args.config:
        from specbench.tune.command import apply_config

        apply_config(args)
    prompts, families = _prompts(args)
    _check_worker_options(args)
    names = [choice.name for choice in parse_methods(args.method, args.k)]  # "chain:3@NAME": own K, own draft
    target = ModelSpec(args.target or DEFAULT_TARGET, dtype=args.dtype, quantization=args.quant, kernels=args.kernels)
    draft = (ModelSpec(args.draft, dtype=args.dtype, quantization=args.draft_quant, kernels=args.kernels)
             if args.draft else None)
    sampling = SamplingParams(temperature=args.temperature, rule=args.rule or sampled_rule(args.temperature, names))
    if args.plan:
        from specbench.methods import get_method

        if draft is None and not any(get_method(m).lookup for m in names):  # no draft: a lookup's planner
            raise SpecbenchError("--plan chooses K per step for a draft/target pair or prompt lookup: pass --draft")
    from specbench.hardware import device_name, target_device

    remote = _remote(args, target) if args.worker else None
    # before the model loads: a pair the cache cannot plan is refused first
    planner = (_planner(args, target, draft, target_device(remote) if remote else device_name(target.device))
               if args.plan else None)
    loaded = load_model(target) if remote is None else None  # loaded once here (the run and the check share it)
    records = run(loaded or remote, prompts, method=args.method, draft=draft, k=args.k,
                  max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, dtype=args.dtype,
                  planner=planner,
                  substitute_quantization=args.substitute_quant, cross_tokenizer=args.cross_tokenizer,
                  fast=args.fast, self_draft_layers=getattr(args, "self_draft_layers", None),
                  router=_router(args, names), suffix=suffix_settings(args), stop_below=args.stop_below,
                  families=families if "auto" in names else None)
    print(summarize(records).round(3).to_string(index=False))
    if not sampling.greedy and not args.rule:  # a rule the user did not name: say which, and why
        why = ("a dynamic tree has no rejection rule, and auto may choose one" if sampling.rule == "sample-match"
               else "exact")
        print(f"verified by {sampling.rule} (the default for these methods at a temperature: {why}; "
              f"--rule picks another)")
    if "target-only" in names:  # why each method paid or not; greedy: whether each output is target-only's
        print("\n".join(speed_verdicts(records)))
        if sampling.greedy and loaded is not None:
            print("\n".join(difference_lines(divergences(records, loaded, prompts), args.dtype)))
        elif sampling.greedy:
            print(_remote_differences(records))
        elif sampling.effective_rule == "sample-match":  # the seed fixes each position's draw: one text
            print(_remote_differences(records, "in fp32 a defect; in bf16 a draw that rounding moved across a "
                                               "boundary of the target's distribution"))
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


def _router(args, names):
    if "auto" not in names:
        return None
    if not args.router:
        raise SpecbenchError("--method auto needs --router FILE (train one with `specbench route`)")
    from specbench.route.router import Router

    return Router.load(args.router)


def _prompts(args) -> tuple[list, list | None]:
    """(the prompts, their families where a dataset names them): --prompt texts, a --prompts dataset or JSONL, or
    the demo's prompts."""
    if args.prompts and args.prompt:
        raise SpecbenchError("--prompt and --prompts both name the prompts: give one of them")
    if args.prompt_count is not None and not args.prompts:
        raise SpecbenchError("--prompt-count samples a --prompts dataset: pass --prompts NAME|JSONL too")
    if args.prompts:
        from specbench.datasets import load_prompts

        rows = load_prompts(args.prompts, limit=args.prompt_count)
        return [row["prompt"] for row in rows], [row["set"] for row in rows]
    from specbench.demo import DEMO_PROMPTS

    return list(args.prompt or DEMO_PROMPTS), None


def _planner(args, target, draft, device: str):
    """--plan's step planner, from a profile of `device` (the target's) where the cache holds one (`run` warns
    where it holds only another device's: its K were priced there)."""
    from specbench.plan.predict import LOOKUP_DRAFT
    from specbench.plan.step_planner import planner_from_caches

    return planner_from_caches(target.label, draft.label if draft else LOOKUP_DRAFT, cs=args.cs, max_k=args.k,
                               draft_budget_mib=args.draft_budget_mib, dtype=args.dtype, prefer=device,
                               where="remote" if args.worker else "local")


def _check_worker_options(args) -> None:
    """Options that describe the target refused where they would do nothing: with a worker, its model is what the
    worker serves unless --target asks for another."""
    if args.curve_keys and not args.worker:
        raise SpecbenchError("--curve-keys are a worker client's keys: pass --worker ENDPOINT too")
    if args.worker and not args.target:
        given = [flag for flag, on in (("--quant", args.quant != "none"), ("--kernels", args.kernels != "default"),
                                       ("--plan", args.plan)) if on]
        if given:
            raise SpecbenchError(f"{', '.join(given)} with --worker need{'s' if len(given) == 1 else ''} --target: "
                                 f"the worker serves its own model unless --target names the one to serve (and the "
                                 f"planner reads its caches)")


def _remote(args, target):
    """The worker as the target; with --target, the worker is asked to serve that model (a worker serving
    another refuses unless it allows the load)."""
    from specbench.worker.client import RemoteTarget

    return RemoteTarget(args.worker, model=target if args.target else None, curve_keys=args.curve_keys)


def _remote_differences(records, differing: str = "in fp32 a defect; in bf16 check them for near-ties in-process "
                                                  "(specbench run without --worker)") -> str:
    """Outputs against target-only's where no near-tie check runs: greedy ones when the target's weights are on a
    worker (the check reads the target's logits), sampled ones under sample-match (one seed, one text)."""
    from specbench.api import outputs

    got = outputs(records)
    differ = sorted({(m, i) for (m, i), tokens in got.items() if m != "target-only" and ("target-only", i) in got
                     and tokens != got[("target-only", i)]})
    if not differ:
        return "every output is target-only's, token for token"
    return "outputs that left target-only's (" + ", ".join(f"{m} prompt {i}" for m, i in differ) + "): " + differing
