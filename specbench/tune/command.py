"""`specbench tune` and `specbench run --config`: the command line of a tune (parsing and dispatch only)."""
from __future__ import annotations

import argparse

from specbench.models.spec import KERNELS, KERNELS_HELP


def add_tune(commands) -> None:
    tune = commands.add_parser("tune", help="profile, record, predict, calibrate and measure: a checked choice of "
                                            "draft, method and K for a target, your prompts and your load")
    tune.add_argument("--target", required=True, help="catalog name, Hugging Face id or path")
    tune.add_argument("--drafts", nargs="+", default=["auto"],
                      help="models, prompt-lookup, suffix, self-draft[:N], substitute[:Q], or auto (every draft that "
                           "could serve; default)")
    tune.add_argument("--prompts", default="bench", help="a dataset name or a JSONL path")
    tune.add_argument("--prompt-count", type=int, default=40)
    tune.add_argument("--calibration-share", type=float, default=0.5,
                      help="share of the prompts acceptance is recorded on; the rest are held back and measured")
    tune.add_argument("--calibration", choices=("runs", "speed", "widths", "per-point"), default="runs",
                      help="runs (default): the target-only run's speed, then each measured point's in-loop forwards "
                           "price the points after it; speed: the first part only; widths / per-point: every "
                           "forward width re-timed after the run / also each point's just before it runs")
    tune.add_argument("--worker", help="the target's worker endpoint (its RTT is measured); default: run it here")
    tune.add_argument("--clients", type=int, nargs="+", default=[1], help="client counts to plan for (a worker)")
    tune.add_argument("--cost", default="total_cost", help="cost objective (plan/objectives.py)")
    tune.add_argument("--cs", type=float, default=0.5, help="cost weight: 0 fastest, 1 cheapest")
    tune.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 6], help="chain lengths to consider")
    tune.add_argument("--tree-budgets", type=int, nargs="*", default=[])
    tune.add_argument("--max-new-tokens", type=int, default=32)
    tune.add_argument("--measure-top", type=int, default=1, help="predicted best points measured, besides each "
                                                                "candidate's best")
    tune.add_argument("--measure-share", type=float, default=0.18,
                      help="of an exhaustive sweep's measuring time (estimated): then the best measured point's "
                           "neighbouring K")
    tune.add_argument("--budget-minutes", type=float, default=15.0)
    tune.add_argument("--temperature", type=float, default=0.0,
                      help="the serving temperature: acceptance recorded and points measured at it (default greedy)")
    tune.add_argument("--rule", choices=("rejection", "sample-match"),
                      help="the sampled runs' verification rule (default: rejection, or sample-match with "
                           "--tree-budgets: dynamic trees need it)")
    tune.add_argument("--dtype", default="float32")
    tune.add_argument("--kernels", default="default", choices=list(KERNELS), help=KERNELS_HELP)
    tune.add_argument("--draft-budget-mib", type=float)
    tune.add_argument("--out-dir", help="default: the user cache's outputs/tune/<target>; a rerun there resumes")
    tune.set_defaults(handler=_tune)


def _tune(args) -> int:
    from specbench.tune import TuneSpec, tune

    spec = TuneSpec(target=args.target, drafts=tuple(args.drafts), prompts=args.prompts, prompt_count=args.prompt_count,
                    calibration_share=args.calibration_share, calibration=args.calibration, endpoint=args.worker,
                    clients=tuple(args.clients),
                    objective=args.cost, cs=args.cs, chain_ks=tuple(args.k), tree_budgets=tuple(args.tree_budgets),
                    max_new_tokens=args.max_new_tokens, measure_top=args.measure_top, measure_share=args.measure_share,
                    budget_minutes=args.budget_minutes, dtype=args.dtype, kernels=args.kernels,
                    draft_budget_mib=args.draft_budget_mib, temperature=args.temperature, rule=args.rule)
    result = tune(spec, args.out_dir)
    columns = ["label", "measured_tokens_per_s", "predicted_tokens_per_s", "calibrated_tokens_per_s", "error_after",
               "flag"]
    print(result.measured[columns].round(3).to_string(index=False))
    if result.side_by_side is not None:  # the close best two, interleaved: what the choice was made on
        print("side by side, every prompt through each in turn:")
        print(result.side_by_side[["label", "measured_tokens_per_s", "tokens_per_step"]].round(3).to_string(index=False))
    if result.hybrid is not None:  # suffix decoding with the best draft, beside the best point: what the choice read
        print("suffix decoding's hybrid beside the best point, every prompt through each in turn:")
        print(result.hybrid[["label", "measured_tokens_per_s", "tokens_per_step"]].round(3).to_string(index=False))
    for line in result.left_out:
        print(f"left out: {line}")
    print(f"chosen: {result.chosen['label']} ({result.chosen['measured_tokens_per_s']} tok/s measured)")
    print(f"configuration: {result.config_path}  (specbench run --config {result.config_path})")
    print(f"report: {result.report_path}")
    return 0


def apply_config(args: argparse.Namespace) -> None:
    """`specbench run --config tune.json`: the tune's choice replaces target, method, draft and K; a choice measured
    through a worker runs through that worker unless `--worker` names another (it ran the target on this machine,
    loading a model the tune never ran here)."""
    from specbench.hardware import machine_label
    from specbench.tune.report import length_note, machine_note, read_config, suffix_words

    config = read_config(args.config)
    if config.get("endpoint") and not getattr(args, "worker", None):
        args.worker = config["endpoint"]
        print(f"through the worker the tune measured at, {args.worker} (--worker ENDPOINT for another)")
    args.target, args.method, args.k = config["target"], ["target-only", config["method"]], config["k"]
    args.suffix = args.suffix or suffix_words(config) or None  # a hybrid's budget for its draft; --suffix overrides
    args.draft = config.get("draft") or args.draft
    args.self_draft_layers = config.get("self_draft_layers")
    if config.get("substitute_quantization"):
        args.substitute_quant = config["substitute_quantization"]
    args.dtype = config.get("dtype", args.dtype)
    if config.get("temperature"):  # the choice was checked at this temperature, under this rule
        args.temperature, args.rule = config["temperature"], config.get("rule") or args.rule
    args.kernels = config.get("kernels", args.kernels)
    for note in (length_note(config.get("max_new_tokens"), args.max_new_tokens),
                 machine_note(config.get("machine"), machine_label())):
        if note:
            print(note[0].upper() + note[1:])
