"""`specbench route`: train a per-prompt router on a dataset and write it where `run --router` reads it."""
from __future__ import annotations

from specbench.route.router import BY_FAMILY, FOLDS, LEARN, MARGIN, parse_margin


def add_route(commands) -> None:
    route = commands.add_parser("route", help="train a per-prompt router (method, K and draft per prompt) on "
                                              "calibration prompts; `specbench run --method auto --router FILE` "
                                              "uses it")
    route.add_argument("--target", required=True, help="catalog name, Hugging Face id or path")
    route.add_argument("--draft", help="the draft model of model-drafting candidates that name none of their own")
    route.add_argument("--candidates", nargs="+", default=["target-only", "prompt-lookup:4", "suffix:16"],
                       help="METHOD[:K][@DRAFT] each: a draft after '@' is that candidate's own, else --draft "
                            "(default %(default)s)")
    route.add_argument("--prompts", default="bench", help="a dataset name or a JSONL path (its families kept)")
    route.add_argument("--prompt-count", type=int, default=40)
    route.add_argument("--max-new-tokens", type=int, default=64)
    route.add_argument("--objective", choices=("speed", "verify_tokens"), default="speed")
    route.add_argument("--margin", type=parse_margin, default=None,
                       help="a prompt leaves the candidate best over all calibration prompts only for one predicted "
                            f"better by more than this share (0: always the predicted best; inf: never; {LEARN}: "
                            f"chosen by cross-validation on the calibration prompts, the default from "
                            f"{2 * FOLDS} prompts; {MARGIN} below that)")
    route.add_argument("--by-family", choices=tuple(BY_FAMILY), default="learn",
                       help="start each prompt from the candidate best over its family's calibration prompts, not "
                            "over all of them (learn: cross-validated with a learned margin, else off)")
    route.add_argument("--dtype", default="float32")
    route.add_argument("--out", default="router.json")
    route.set_defaults(handler=_route)


def _route(args) -> int:
    from specbench.datasets import load_prompts
    from specbench.models.spec import ModelSpec
    from specbench.route.auto import candidates_from, train_router

    candidates = candidates_from(args.candidates)  # refused by name before anything loads
    rows = load_prompts(args.prompts, limit=args.prompt_count)
    draft = ModelSpec(args.draft, dtype=args.dtype) if args.draft else None
    router, records = train_router(ModelSpec(args.target, dtype=args.dtype), [row["prompt"] for row in rows],
                                   candidates, draft=draft, families=[row["set"] for row in rows],
                                   objective=args.objective, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                                   margin=args.margin, by_family=BY_FAMILY[args.by_family])
    path = router.save(args.out)
    counts = records.groupby("method")["emitted"].sum() / records.groupby("method")["step_s"].sum()
    print("calibration tokens/s: " + ", ".join(f"{method} {speed:.2f}" for method, speed in counts.items()))
    leave = "never left" if router.margin == float("inf") else f"left for another predicted {router.margin:.0%} better"
    print(f"router: {path} ({len(candidates)} candidates, families {router.families or 'none'}; default "
          f"{router.default}, {leave}; calibrated on replies of up to {router.reply_tokens} tokens)")
    if router.margins:
        print("margin cross-validated, tokens/s by margin: "
              + ", ".join(f"{m:.0%} {score:.2f}" for m, score in router.margins.items()))
    if router.family_margins:
        print("the same, each prompt starting from its family's default: "
              + ", ".join(f"{m:.0%} {score:.2f}" for m, score in router.family_margins.items()))
    if router.by_family:
        print("family defaults used: " + ", ".join(f"{f} {label}" for f, label in router.family_defaults.items()))
    return 0
