"""The `specbench` command: models, datasets, run, worker, profile, reference, pareto, and the main job (`demo`)."""
from __future__ import annotations

import argparse
import sys

from specbench.models.spec import KERNELS, KERNELS_HELP, QUANTIZATIONS
from specbench.methods import CROSS_TOKENIZER
from specbench.plan.reference import HYBRIDS
from specbench.types import FAST_BACKENDS, STOP_BELOW, VERIFY_RULES, SpecbenchError

FAST_HELP = "static KV caches, compiled fixed-shape steps (CUDA graphs on a GPU); default: on for unquantized CUDA models"


def _models(args) -> int:
    from specbench.models import catalog

    if args.action == "list":
        for entry in catalog.CATALOG.values():
            state = "ready" if catalog.is_ready(entry.name) else "not fetched"
            print(f"{entry.name:22s} {entry.size / 2**20:8.1f} MiB  {state:12s} {entry.description}")
        print(f"cache: {catalog.cache_root()}")
        return 0
    names = args.names or ["smollm2-135m"]
    for name in names:
        if args.action == "fetch":
            print(catalog.ensure_model(name))
        else:
            catalog.fetch_gguf(name)
            catalog.verify_gguf(name)
            print(f"{name}: sha256 ok")
    return 0


def _run(args) -> int:
    from specbench.run_command import run_command

    return run_command(args)


def _demo(args) -> int:
    from specbench.demo import main_job

    main_job(k=args.k, max_new_tokens=args.max_new_tokens, dtype=args.dtype, rtt_ms=args.rtt, out_dir=args.out_dir,
             cross_family=args.cross_family)
    return 0


def _profile(args) -> int:
    from specbench.measure_command import profile

    return profile(args)


def _reference(args) -> int:
    from specbench.measure_command import reference

    return reference(args)


def _pareto(args) -> int:
    """Predict every operating point for each cached pair and write an HTML Pareto report."""
    from specbench.plan.costs import Power, Prices
    from specbench.plan.explore import pair_predictions
    from specbench.plan.library import PROFILES, REFERENCES, load_profiles, load_references
    from specbench.viz.report import write_pareto_report

    prices = Prices(target_usd_per_hour=args.usd_per_hour, draft_usd_per_kwh=args.usd_per_kwh, usd_per_gb_down=args.usd_per_gb)
    power = Power(draft_watts=args.draft_watts, target_watts=args.target_watts)
    references = load_references(args.references or REFERENCES, args.by_family)
    sections = pair_predictions(load_profiles(args.profiles or PROFILES), references,
                                rtts_ms=args.rtt, target=args.target, prices=prices, power=power, context=args.context,
                                cost=args.cost, free_drafts=True,  # prompt lookup and suffix beside the model drafts
                                draft_budget_bytes=args.draft_budget_mib * 2**20 if args.draft_budget_mib else None)
    for section in sections:
        predicted = section["predicted"]
        best = predicted[predicted["fits"]].sort_values("tokens_per_s", ascending=False).iloc[0]
        over = int((~predicted["fits"]).sum())
        print(f"{section['title']}: fastest {best['label']} {best['tokens_per_s']:.2f} tok/s"
              + (f" ({over} points over the draft memory budget)" if over else ""))
    path = write_pareto_report(args.out, [dict(s, cs=args.cs) for s in sections], cost=args.cost)
    print(f"Pareto report: {path.resolve()}")
    return 0


def _datasets(args) -> int:
    from specbench.datasets import DATASETS, fetch_dataset, load_prompts
    from specbench.datasets.sources import LOCAL, dataset_path

    if args.action == "list":
        for name, path in LOCAL.items():
            print(f"{name:12s} (in the repository) {path}")
        for source in DATASETS.values():
            state = "fetched" if dataset_path(source.name).exists() else "not fetched"
            print(f"{source.name:12s} {source.package}=={source.version:8s} {state:12s} {source.description}")
        return 0
    if not args.name:
        raise SpecbenchError(f"`datasets {args.action}` needs a dataset name or JSONL path")
    if args.action == "fetch":
        print(fetch_dataset(args.name))
        return 0
    for row in load_prompts(args.name, limit=args.limit, seed=args.seed):
        text = row["prompt"].replace("\n", " ")
        print(f"[{row['set']}/{row['id']}] {text[:100]}{'...' if len(text) > 100 else ''}")
    return 0


def _worker(args) -> int:
    import logging
    from datetime import datetime

    from specbench.models.spec import ModelSpec
    from specbench.worker.limits import LIMIT_FLAGS, WorkerLimits
    from specbench.worker.server import Worker, WorkerConfig

    def log(line: str) -> None:
        print(f"{datetime.now().isoformat(timespec='seconds')} {line}", flush=True)

    logging.getLogger("transformers").setLevel(logging.ERROR)
    spec = lambda name: ModelSpec(name, dtype=args.dtype, device=args.device, quantization=args.quant,  # noqa: E731
                                  kernels=args.kernels) if name else None
    # every limit is a flag named in LIMIT_FLAGS (the KV budget given in GiB)
    limits = WorkerLimits(**{name: getattr(args, name) for name in LIMIT_FLAGS if name != "max_kv_bytes"},
                          max_kv_bytes=int(args.max_kv_gib * 2**30) if args.max_kv_gib else None)
    if args.router:  # a router file it cannot read or route with within its limits is refused before it serves
        from specbench.worker.long_requests import router_machine_note, worker_router

        note = router_machine_note(worker_router(args.router, limits).machine, args.device)
        if note:  # said once, at start: every auto-server request routes on this machine
            log(note)
    config = WorkerConfig(bind=args.bind, model=spec(args.model),
                          draft=ModelSpec(args.draft, dtype=args.dtype, device=args.device) if args.draft else None,
                          device=args.device, lazy=args.lazy, allow_load=tuple(args.allow_load),
                          idle_timeout_s=args.idle_timeout, limits=limits, curve_keys=args.curve_keys,
                          insecure=args.insecure, batching=not args.no_batching,
                          batch_window_ms=args.batch_window_ms, batch_wait_ms=args.batch_wait_ms,
                          max_batch=args.max_batch, slice_tokens=args.slice_tokens, fast=args.fast,
                          suffix_cache=args.suffix_cache, router=args.router)
    Worker(config, log=log).serve()
    return 0


def _sweep(args) -> int:
    """Run a grid's unfinished cells (locally or on Ray) and print each cell's summary per method."""
    from specbench.sweep import load_grid, summarize_sweep, sweep

    cells = load_grid(args.grid)
    report = sweep(cells, args.out, executor=args.executor, cpus_per_cell=args.cpus_per_cell,
                   gpus_per_cell=args.gpus_per_cell, retry_failed=not args.no_retry_failed)
    print(f"{len(cells)} cells: ran {report.ran} ({report.failed} failed), skipped {report.skipped} already "
          f"finished, {report.wall_s:.1f} s -> {report.folder}")
    table = summarize_sweep(report.records, cells)
    if len(table):
        shown = ["cell", "target", "target_quantization", "draft", "draft_quantization", "dataset", "k", "method",
                 "tokens_per_s", "tokens_per_step", "acceptance_rate"]
        print(table[shown].round(3).to_string(index=False))
    failed = report.status[report.status["state"] == "failed"]
    for _, row in failed.iterrows():
        print(f"failed {row['cell']} ({row['describe']}): {row['error']}", file=sys.stderr)
    return 1 if len(failed) else 0


def build_parser() -> argparse.ArgumentParser:
    from specbench.plan.objectives import OBJECTIVES
    from specbench.worker.keys import keys_command
    from specbench.worker.limits import LIMIT_FLAGS, WorkerLimits

    parser = argparse.ArgumentParser(prog="specbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="list, fetch or verify the embedded model catalog")
    models.add_argument("action", choices=["list", "fetch", "verify"])
    models.add_argument("names", nargs="*")
    models.set_defaults(handler=_models)

    run_parser = commands.add_parser("run", help="run methods on prompts and print the summary; with target-only "
                                     "among them, why each method paid or not and (greedy) whether every output is "
                                     "target-only's, each difference shown a near-tie or a defect")
    run_parser.add_argument("--target", help="catalog name, Hugging Face id or path (default smollm2-135m; with "
                                             "--worker: the model the worker is asked to serve, else its own)")
    run_parser.add_argument("--draft")
    run_parser.add_argument("--method", nargs="+", default=["target-only", "prompt-lookup"],
                            help="methods side by side, each as METHOD[:K][@DRAFT]: its own K, its own draft model "
                                 "(e.g. chain-confident:12@smollm2-135m beside chain-confident:12 with --draft)")
    run_parser.add_argument("--prompt", action="append", help="a prompt's text (repeat the flag for more)")
    run_parser.add_argument("--prompts", help="a dataset name or a JSONL path, in place of --prompt (its families go "
                                              "to --method auto's router)")
    run_parser.add_argument("--prompt-count", type=int, help="with --prompts: a seeded sample of this many")
    run_parser.add_argument("--worker", metavar="ENDPOINT", help="verify on a worker (`specbench worker`), e.g. "
                                                                 "tcp://127.0.0.1:5555; drafts still run here")
    run_parser.add_argument("--curve-keys", metavar="DIR", help="with --worker: the client keys (`specbench keys`)")
    run_parser.add_argument("--k", type=int, default=4)
    run_parser.add_argument("--max-new-tokens", type=int, default=64)
    run_parser.add_argument("--temperature", type=float, default=0.0)
    run_parser.add_argument("--rule", choices=list(VERIFY_RULES),
                            help="verification rule (default: greedy at temperature 0, else rejection, or "
                                 "sample-match where a method needs it: dynamic trees, auto)")
    run_parser.add_argument("--seed", type=int, default=0, help="the sampled runs' seed (the same seed, the same text)")
    run_parser.add_argument("--stop-below", type=float, default=STOP_BELOW, metavar="P",
                            help="chain-confident and suffix-tree-chain-confident: end a chain after a token its draft "
                                 "gave less than P (--k is the cap; default %(default)s, Hugging Face's assisted "
                                 "generation's)")
    run_parser.add_argument("--dtype", default="float32")
    run_parser.add_argument("--quant", default="none", choices=list(QUANTIZATIONS), help="target quantization")
    run_parser.add_argument("--kernels", default="default", choices=list(KERNELS), help=KERNELS_HELP)
    run_parser.add_argument("--draft-quant", default="none", choices=list(QUANTIZATIONS), help="draft quantization")
    run_parser.add_argument("--substitute-quant", default="8bit", choices=list(QUANTIZATIONS)[1:],
                            help="the substitute method's draft: the target itself, quantized (default %(default)s)")
    run_parser.add_argument("--cross-tokenizer", default="auto", choices=list(CROSS_TOKENIZER),
                            help="a draft with another tokenizer: auto (text, or shared-vocab for rejection), "
                                 "text, shared-vocab, or off (refuse it)")
    run_parser.add_argument("--fast", nargs="?", const="auto", choices=("auto", "off") + FAST_BACKENDS, help=FAST_HELP)
    run_parser.add_argument("--out", help="write the per-step records as CSV")
    run_parser.add_argument("--config", help="a `specbench tune` configuration (tune.json): its target, method, draft "
                                             "and K, beside target-only; through the worker it was measured at, "
                                             "unless --worker names another")
    run_parser.add_argument("--plan", action="store_true",
                            help="choose K per step (up to --k) from the cached profiles and reference of the pair")
    run_parser.add_argument("--cs", type=float, default=0.0, help="cost weight for --plan: 0 fastest, 1 cheapest")
    run_parser.add_argument("--draft-budget-mib", type=float, default=None,
                            help="with --plan: the draft device's memory; K only where the draft's weights and "
                                 "cache fit, plain target steps beyond")
    run_parser.add_argument("--suffix", nargs="+", metavar="KEY=VALUE",
                            help="suffix decoding's settings, e.g. min_score=2 factor=2 cache=drafter (the fields of "
                                 "SuffixSettings; docs/methods/suffix.md)")
    run_parser.add_argument("--router", help="method auto: the router file (`specbench route`) that picks each "
                                             "prompt's method and K")
    run_parser.set_defaults(handler=_run)

    from specbench.heads.command import add_train_draft
    from specbench.serve.command import add_serve
    from specbench.route.command import add_route
    from specbench.tune.command import add_tune

    add_tune(commands)
    add_route(commands)
    add_serve(commands)
    add_train_draft(commands)
    worker = commands.add_parser("worker", help="serve a target model over ZeroMQ (Ctrl-C stops it)")
    worker.add_argument("--bind", default="tcp://127.0.0.1:5555")
    worker.add_argument("--model", help="catalog name, Hugging Face id or path")
    worker.add_argument("--draft", help="draft model for the server-only baseline")
    worker.add_argument("--quant", default="none", choices=list(QUANTIZATIONS))
    worker.add_argument("--kernels", default="default", choices=list(KERNELS), help=KERNELS_HELP)
    worker.add_argument("--dtype", default="float32")
    worker.add_argument("--device", default="cpu")
    worker.add_argument("--lazy", action="store_true", help="load the model on first use, not at start")
    worker.add_argument("--allow-load", action="append", default=[], metavar="MODEL",
                        help="a model clients may load besides --model/--draft (repeat the flag for more)")
    worker.add_argument("--idle-timeout", type=float, default=900.0, help="seconds before an idle session expires")
    worker.add_argument("--no-batching", action="store_true",
                        help="one request at a time (default: verifies of different sessions share one forward)")
    worker.add_argument("--batch-window-ms", type=float, default=20.0, help="least wait for others' steps (default %(default)s)")
    worker.add_argument("--batch-wait-ms", default="auto", help="how long at most to wait for a session expected back "
                        "from drafting (ms; default auto: a forward's fixed cost, fitted; 0: only --batch-window-ms)")
    worker.add_argument("--max-batch", type=int, default=16, help="requests taken in one round (default %(default)s)")
    worker.add_argument("--slice-tokens", "--prefill-chunk", dest="slice_tokens", type=int, default=256,
                        help="new tokens one slice of a long request computes (a prefill chunk, a profile piece): "
                             "other clients' steps run between slices (default %(default)s)")
    worker.add_argument("--suffix-cache", choices=("tenant", "shared", "off"), default="tenant",
                        help="suffix-server's cache of earlier outputs: one per tenant (default), one for all, or none")
    worker.add_argument("--router", help="a router file (`specbench route`): method auto-server routes each "
                                         "prompt to a worker method and K with it")
    defaults = WorkerLimits()
    for name, (flag, what) in LIMIT_FLAGS.items():
        if name == "max_kv_bytes":
            worker.add_argument(flag, type=float, help=f"{what}, GiB (default: half the memory free at start)")
        else:
            worker.add_argument(flag, type=int, default=getattr(defaults, name), help=f"{what} (default %(default)s)")
    worker.add_argument("--fast", nargs="?", const="auto", choices=("auto", "off") + FAST_BACKENDS, help=FAST_HELP)
    worker.add_argument("--curve-keys", help="folder made by `specbench keys`: CURVE encryption and client auth")
    worker.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without CURVE keys")
    worker.set_defaults(handler=_worker)

    profile = commands.add_parser("profile", help="measure forward latency over a tokens x context grid")
    source = profile.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="catalog name, Hugging Face id or path (measured here)")
    source.add_argument("--worker", help="endpoint of a worker to measure its loaded target on its hardware")
    profile.add_argument("--dtype", default="float32")
    profile.add_argument("--quant", default="none", choices=list(QUANTIZATIONS))
    profile.add_argument("--kernels", default="default", choices=list(KERNELS), help=KERNELS_HELP)
    profile.add_argument("--self-draft-layers", type=int, help="profile the first N layers of --model")
    profile.add_argument("--head", help="a draft head's folder: profile its forward (--model names its target)")
    profile.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64])
    profile.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    profile.add_argument("--repeats", type=int, default=5)
    profile.add_argument("--batches", type=int, nargs="+", default=[1],
                         help="batch sizes: a target shared by that many clients (default: 1)")
    profile.add_argument("--fast", nargs="?", const="auto", choices=("auto",) + FAST_BACKENDS, help=FAST_HELP)
    profile.add_argument("--out-dir", help="default: your own profiles, in the user cache (the shipped profiles/ "
                         "only when named)")
    profile.set_defaults(handler=_profile)

    reference = commands.add_parser("reference", help="record per-step acceptance of a pair on a prompt set")
    reference.add_argument("--target", required=True)
    reference.add_argument("--draft", help="a draft model, a draft head's folder (its eagle chains and trees), "
                                           "prompt-lookup or suffix (their own drafts, no model)")
    reference.add_argument("--draft-quant", default="none", choices=list(QUANTIZATIONS))
    reference.add_argument("--target-quant", default="none", choices=list(QUANTIZATIONS))
    reference.add_argument("--self-draft-layers", type=int)
    reference.add_argument("--dataset", default="bench", help="dataset name or a JSONL file of prompts")
    reference.add_argument("--dataset-label", help="name stored in the reference (default: --dataset)")
    reference.add_argument("--prompts", type=int, default=6)
    reference.add_argument("--max-chain", type=int, default=8)
    reference.add_argument("--tree-budgets", type=int, nargs="*", default=[8, 16, 32])
    reference.add_argument("--max-new-tokens", type=int, default=64)
    reference.add_argument("--temperature", type=float, default=0.0)
    reference.add_argument("--rule", choices=list(VERIFY_RULES),
                           help="verification rule (default: greedy at temperature 0, else rejection)")
    reference.add_argument("--dtype", default="float32")
    reference.add_argument("--cross-tokenizer", default="auto", choices=list(CROSS_TOKENIZER),
                           help="a draft with another tokenizer: how its drafts become target ids")
    reference.add_argument("--hybrid", type=int, nargs="*", default=[], metavar="BUDGET",
                           help="also run suffix decoding's hybrid with this draft at each suffix budget, so the "
                                "planner prices it (a draft model or a head)")
    reference.add_argument("--hybrid-method", choices=list(HYBRIDS),
                           help="default: suffix-tree-chain for a draft model, suffix-eagle-tree for a head")
    reference.add_argument("--suffix", nargs="*", default=[], metavar="KEY=VALUE",
                           help="the hybrid's suffix knobs, e.g. hand_over=0.5 other_k=3 catch_up=4")
    reference.add_argument("--out-dir", help="default: your own references, in the user cache (the shipped "
                           "reference/ only when named)")
    reference.set_defaults(handler=_reference)

    pareto = commands.add_parser("pareto", help="write an HTML latency-cost Pareto report from the caches")
    pareto.add_argument("--out", default="reports/pareto.html")
    pareto.add_argument("--target", help="only references with this target")
    pareto.add_argument("--by-family", action="store_true",
                        help="also a section per family of references that recorded their prompts' families")
    pareto.add_argument("--rtt", type=float, nargs="*", default=[10.0, 50.0, 100.0],
                        help="also predict a remote target at these RTTs (ms)")
    pareto.add_argument("--cs", type=float, default=0.5, help="cost weight in [0, 1]: 0 fastest, 1 cheapest")
    pareto.add_argument("--cost", default="total_cost", choices=list(OBJECTIVES),
                        help="cost objective (plan/objectives.py)")
    pareto.add_argument("--context", type=int, default=256)
    pareto.add_argument("--draft-budget-mib", type=float,
                        help="draft device memory budget: drafts whose weights + a --context cache exceed it are "
                             "shown greyed and never recommended")
    pareto.add_argument("--usd-per-hour", type=float, default=2.0, help="target GPU $/hour")
    pareto.add_argument("--usd-per-kwh", type=float, default=0.30, help="draft-side electricity")
    pareto.add_argument("--usd-per-gb", type=float, default=0.09, help="egress $/GB")
    pareto.add_argument("--draft-watts", type=float, default=15.0)
    pareto.add_argument("--target-watts", type=float, default=350.0)
    pareto.add_argument("--profiles", help="folder of profiles (default: the repository's profiles/)")
    pareto.add_argument("--references", help="folder of references (default: the repository's reference/)")
    pareto.set_defaults(handler=_pareto)

    datasets = commands.add_parser("datasets", help="list, fetch or show prompt sets")
    datasets.add_argument("action", choices=["list", "fetch", "show"])
    datasets.add_argument("name", nargs="?", help="dataset name or a JSONL path")
    datasets.add_argument("--limit", type=int, default=5)
    datasets.add_argument("--seed", type=int, default=0)
    datasets.set_defaults(handler=_datasets)

    keys = commands.add_parser("keys", help="create CURVE keys for a worker and a client")
    keys.add_argument("folder")
    keys.add_argument("--force", action="store_true", help="replace keys already in the folder")
    keys.set_defaults(handler=keys_command)

    demo = commands.add_parser("demo", help="the main job on the embedded models")
    demo.add_argument("--k", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--dtype", default="float32")
    demo.add_argument("--rtt", type=float, default=50.0, help="emulated RTT for the remote part (ms)")
    demo.add_argument("--out-dir", default="reports", help="where the records CSV and the HTML report go")
    demo.add_argument("--cross-family", action=argparse.BooleanOptionalAction, default=True,
                      help="SmolLM2-135M drafting for Qwen2.5-Coder-1.5B through text, the row that pays on a CPU "
                           "(a 1.1 GB download once; --no-cross-family skips it)")
    demo.set_defaults(handler=_demo)

    sweep_parser = commands.add_parser("sweep", help="run a sweep grid, resumable, locally or on a Ray cluster")
    sweep_parser.add_argument("grid", help="a JSON grid ({axes, fixed} or {grids: [...]}) or a CSV of cells")
    sweep_parser.add_argument("--out", default="results/sweep", help="results folder; a rerun skips finished cells")
    sweep_parser.add_argument("--executor", default="local",
                              help="local, ray (a local cluster or RAY_ADDRESS), or a Ray address (default %(default)s)")
    sweep_parser.add_argument("--cpus-per-cell", type=int, default=1)
    sweep_parser.add_argument("--gpus-per-cell", type=float, default=0.0)
    sweep_parser.add_argument("--no-retry-failed", action="store_true", help="leave cells that failed before")
    sweep_parser.set_defaults(handler=_sweep)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from specbench.models.notices import plain_warnings, quiet_library_notices

    plain_warnings()
    if args.command != "keys":
        quiet_library_notices()
    try:
        return args.handler(args)
    except SpecbenchError as error:
        print(f"specbench: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
