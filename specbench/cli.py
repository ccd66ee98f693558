"""The `specbench` command: models, datasets, run, worker, profile, reference, pareto, and the main job (`demo`)."""
from __future__ import annotations

import argparse
import sys

from specbench.types import SamplingParams, SpecbenchError

DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences what a hash map is.",
    "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"",
]


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
    from specbench.api import run
    from specbench.decode.metrics import summarize
    from specbench.models.spec import ModelSpec

    target = ModelSpec(args.target, dtype=args.dtype)
    draft = ModelSpec(args.draft, dtype=args.dtype) if args.draft else None
    sampling = SamplingParams(temperature=args.temperature, rule=args.rule)
    planner = None
    if args.plan:
        from specbench.plan.step_planner import planner_from_caches

        if draft is None:
            raise SpecbenchError("--plan chooses K per step for a draft/target pair: pass --draft")
        planner = planner_from_caches(target.label, draft.label, cs=args.cs, max_k=args.k)
    records = run(target, args.prompt or DEMO_PROMPTS, method=args.method, draft=draft, k=args.k,
                  max_new_tokens=args.max_new_tokens, sampling=sampling, dtype=args.dtype, planner=planner)
    print(summarize(records).round(3).to_string(index=False))
    if args.out:
        records.to_csv(args.out, index=False)
        print(f"per-step records: {args.out}")
    return 0


def _demo(args) -> int:
    """The main job: embedded SmolLM2; local and remote (a worker on loopback) SD vs target-only;
    a Pareto report from the cached profiles and references with this run's points overlaid."""
    from pathlib import Path

    import pandas as pd

    from specbench.api import outputs, run
    from specbench.decode.metrics import summarize
    from specbench.models import catalog
    from specbench.models.loading import load_model
    from specbench.models.self_draft import truncated_view
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import NetworkEmulation, RemoteTarget
    from specbench.worker.launch import free_port, spawn_worker

    root = Path(__file__).resolve().parents[1]
    print("[1/4] embedded model SmolLM2-135M-Instruct (fetched and converted once into the user cache)", flush=True)
    catalog.ensure_model("smollm2-135m")
    target = load_model(ModelSpec("smollm2-135m", dtype=args.dtype))
    draft = truncated_view(target, 26)
    print("[2/4] local: target-only vs every lossless method, greedy, CPU", flush=True)
    local = run(target, DEMO_PROMPTS, method=["target-only", "prompt-lookup", "self-draft", "substitute"], k=args.k,
                max_new_tokens=args.max_new_tokens, self_draft_layers=26, dtype=args.dtype)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    print(f"[3/4] remote: a worker on {endpoint}, emulated RTT {args.rtt:g} ms, the draft here", flush=True)
    worker = spawn_worker(endpoint, "--model", "smollm2-135m", "--dtype", args.dtype)
    try:
        remote = RemoteTarget(endpoint, network=NetworkEmulation(rtt_ms=args.rtt))
        remote_records = run(remote, DEMO_PROMPTS, method=["target-only", "chain"], draft=draft, k=args.k,
                             max_new_tokens=args.max_new_tokens, tokenizer=target.tokenizer)
    finally:
        worker.terminate()
    records = pd.concat([local.assign(where="local"),
                         remote_records.assign(where=f"remote (emulated RTT {args.rtt:g} ms)")], ignore_index=True)
    reference = outputs(local)
    table = summarize(records, by=["where", "method"])
    produced = {"local": local, "remote": remote_records}
    table["identical_to_target_only"] = [
        all(outputs(produced["local" if where == "local" else "remote"])[(method, i)] == reference[("target-only", i)]
            for i in range(len(DEMO_PROMPTS))) for where, method in zip(table["where"], table["method"])]
    print(table.round(3).to_string(index=False))
    print("(self-draft and remote chain = SmolLM2's first 26 of 30 layers as the draft; substitute = its own "
          "8-bit twin)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records.to_csv(out / "demo_records.csv", index=False)
    print("[4/4] Pareto report from the cached profiles/ and reference/", flush=True)
    report = _write_demo_report(out / "pareto.html", local, args)
    print(f"\nper-step records: {(out / 'demo_records.csv').resolve()}")
    print(f"Pareto report:    {report.resolve()}" if report else "Pareto report: no cached profiles found")
    print(f"notebooks:        {(root / 'notebooks').resolve()}  (jupyter lab notebooks/)")
    return 0


def _write_demo_report(path, local, args):
    """Every cached pair as a section; SmolLM2's section gets this run's measured points overlaid."""
    from specbench.hardware import device_name
    from specbench.plan.explore import matching_pairs, measured_points, operating_points, prediction_frame
    from specbench.plan.library import load_profiles, load_references
    from specbench.viz.report import write_pareto_report

    sections, here = [], device_name("cpu")
    for target, draft, reference in matching_pairs(load_profiles(), load_references()):
        frame = prediction_frame(target, draft, reference, operating_points(reference, rtts_ms=(args.rtt,), remote=True))
        measured = None
        if target.model == "smollm2-135m" and target.device == here and target.dtype == args.dtype:
            measured = measured_points(local[local["method"].isin(["target-only", "self-draft"])])
        sections.append({"title": f"{reference.draft} -> {reference.target} on {target.device} ({target.dtype}, "
                                  f"{reference.dataset})", "predicted": frame, "measured": measured})
    if not sections:
        return None
    return write_pareto_report(path, sections, note="Measured diamonds: this demo run (local, greedy).")

def _profile(args) -> int:
    """Measure forward latency over the grid, locally or on a worker, and save it to profiles/."""
    from specbench.plan.library import PROFILES, save_profile
    from specbench.record import profile_model, profile_worker

    grid = dict(tokens=args.tokens, contexts=args.contexts, repeats=args.repeats)
    if args.worker:
        profile, extra = profile_worker(args.worker, **grid)
    else:
        from specbench.api import as_loaded
        from specbench.models.spec import ModelSpec

        loaded = as_loaded(ModelSpec(args.model, dtype=args.dtype, quantization=args.quant), args.dtype)
        if args.self_draft_layers:
            from specbench.models.self_draft import truncated_view

            loaded = truncated_view(loaded, args.self_draft_layers)
        profile, extra = profile_model(loaded, **grid)
    path = save_profile(profile, extra, folder=args.out_dir or PROFILES)
    print(f"{profile.model} on {profile.device} ({profile.dtype}): {len(profile.rows)} grid points -> {path}")
    return 0


def _reference(args) -> int:
    """Record per-step acceptance of a pair on a prompt set and save it to reference/."""
    from specbench.api import as_loaded
    from specbench.datasets import load_prompts
    from specbench.models.spec import ModelSpec
    from specbench.plan.library import REFERENCES, save_reference
    from specbench.record import record_reference

    target = as_loaded(ModelSpec(args.target, dtype=args.dtype), args.dtype)
    if args.self_draft_layers:
        from specbench.models.self_draft import truncated_view

        draft = truncated_view(target, args.self_draft_layers)
    elif args.draft:
        draft = as_loaded(ModelSpec(args.draft, dtype=args.dtype, quantization=args.draft_quant), args.dtype)
    else:
        raise SpecbenchError("give --draft MODEL or --self-draft-layers N")
    prompts = [row["prompt"] for row in load_prompts(args.dataset, limit=args.prompts)]
    sampling = SamplingParams(temperature=args.temperature, rule=args.rule)
    reference = record_reference(target, draft, prompts, dataset=args.dataset_label or args.dataset,
                                 max_chain=args.max_chain, tree_budgets=args.tree_budgets,
                                 max_new_tokens=args.max_new_tokens, sampling=sampling)
    path = save_reference(reference, {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens},
                          folder=args.out_dir or REFERENCES)
    print(f"{reference.draft} -> {reference.target} on {reference.dataset}: {len(reference.chain_accepts)} chain "
          f"steps, tree budgets {sorted(reference.tree_accepts)} -> {path}")
    return 0


def _pareto(args) -> int:
    """Predict every operating point for each cached pair and write an HTML Pareto report."""
    from specbench.plan.costs import Power, Prices
    from specbench.plan.explore import matching_pairs, operating_points, prediction_frame
    from specbench.plan.library import PROFILES, REFERENCES, load_profiles, load_references
    from specbench.viz.report import write_pareto_report

    prices = Prices(target_usd_per_hour=args.usd_per_hour, draft_usd_per_kwh=args.usd_per_kwh,
                    usd_per_gb_down=args.usd_per_gb)
    power = Power(draft_watts=args.draft_watts, target_watts=args.target_watts)
    pairs = matching_pairs(load_profiles(args.profiles or PROFILES), load_references(args.references or REFERENCES),
                           target=args.target)
    sections = []
    for target, draft, reference in pairs:
        points = operating_points(reference, rtts_ms=args.rtt, remote=bool(args.rtt))
        frame = prediction_frame(target, draft, reference, points, prices, power, context=args.context,
                                 cost=args.cost)
        sections.append({"title": f"{reference.draft} -> {reference.target} on {target.device} "
                                  f"({target.dtype}, {reference.dataset})", "predicted": frame, "cs": args.cs})
        best = frame.sort_values("tokens_per_s", ascending=False).iloc[0]
        print(f"{sections[-1]['title']}: fastest {best['label']} {best['tokens_per_s']:.2f} tok/s")
    if not sections:
        raise SpecbenchError("no reference with matching target and draft profiles on one device; "
                             "run `specbench profile` and `specbench reference` first")
    path = write_pareto_report(args.out, sections, cost=args.cost)
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
    from specbench.worker.limits import WorkerLimits
    from specbench.worker.server import Worker, WorkerConfig

    def log(line: str) -> None:
        print(f"{datetime.now().isoformat(timespec='seconds')} {line}", flush=True)

    logging.getLogger("transformers").setLevel(logging.ERROR)
    spec = lambda name: ModelSpec(name, dtype=args.dtype, device=args.device, quantization=args.quant) if name else None
    limits = WorkerLimits(
        max_sessions=args.max_sessions, max_sessions_per_client=args.max_sessions_per_client,
        max_prompt_tokens=args.max_prompt_tokens, max_tree_nodes=args.max_tree_nodes,
        max_new_tokens=args.max_new_tokens, max_profile_points=args.max_profile_points,
        max_profile_repeats=args.max_profile_repeats,
        max_kv_bytes=int(args.max_kv_gib * 2**30) if args.max_kv_gib else None,
        max_request_bytes=args.max_request_bytes, inbound_queue=args.inbound_queue)
    config = WorkerConfig(bind=args.bind, model=spec(args.model),
                          draft=ModelSpec(args.draft, dtype=args.dtype, device=args.device) if args.draft else None,
                          device=args.device, lazy=args.lazy, allow_load=tuple(args.allow_load),
                          idle_timeout_s=args.idle_timeout, limits=limits, curve_keys=args.curve_keys,
                          insecure=args.insecure)
    Worker(config, log=log).serve()
    return 0


def _keys(args) -> int:
    """Create a CURVE key pair for the worker and one for a client, in the layout both expect."""
    from pathlib import Path

    import zmq.auth

    folder = Path(args.folder)
    (folder / "clients").mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    for name in ("server", "client"):
        _, secret = zmq.auth.create_certificates(folder, name)
        Path(secret).chmod(0o600)  # a secret key readable by others is no secret
    (folder / "clients" / "client.key").write_bytes((folder / "client.key").read_bytes())
    print(f"worker: --curve-keys {folder}  (clients allowed: {folder / 'clients'}/*.key)")
    print(f"client: RemoteTarget(..., curve_keys='{folder}')  (needs server.key and client.key_secret)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from specbench.worker.limits import LIMIT_FLAGS, WorkerLimits

    parser = argparse.ArgumentParser(prog="specbench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="list, fetch or verify the embedded model catalog")
    models.add_argument("action", choices=["list", "fetch", "verify"])
    models.add_argument("names", nargs="*")
    models.set_defaults(handler=_models)

    run_parser = commands.add_parser("run", help="run methods on prompts and print the summary")
    run_parser.add_argument("--target", default="smollm2-135m")
    run_parser.add_argument("--draft")
    run_parser.add_argument("--method", nargs="+", default=["target-only", "prompt-lookup"])
    run_parser.add_argument("--prompt", action="append")
    run_parser.add_argument("--k", type=int, default=4)
    run_parser.add_argument("--max-new-tokens", type=int, default=64)
    run_parser.add_argument("--temperature", type=float, default=0.0)
    run_parser.add_argument("--rule", default="rejection", choices=["greedy", "rejection", "sample-match"])
    run_parser.add_argument("--dtype", default="float32")
    run_parser.add_argument("--out", help="write the per-step records as CSV")
    run_parser.add_argument("--plan", action="store_true",
                            help="choose K per step (up to --k) from the cached profiles and reference of the pair")
    run_parser.add_argument("--cs", type=float, default=0.0, help="cost weight for --plan: 0 fastest, 1 cheapest")
    run_parser.set_defaults(handler=_run)

    worker = commands.add_parser("worker", help="serve a target model over ZeroMQ (Ctrl-C stops it)")
    worker.add_argument("--bind", default="tcp://127.0.0.1:5555")
    worker.add_argument("--model", help="catalog name, Hugging Face id or path")
    worker.add_argument("--draft", help="draft model for the server-only baseline")
    worker.add_argument("--quant", default="none", choices=["none", "8bit", "4bit"])
    worker.add_argument("--dtype", default="float32")
    worker.add_argument("--device", default="cpu")
    worker.add_argument("--lazy", action="store_true", help="load the model on first use, not at start")
    worker.add_argument("--allow-load", action="append", default=[], metavar="MODEL",
                        help="a model clients may load besides --model/--draft (repeat the flag for more)")
    worker.add_argument("--idle-timeout", type=float, default=900.0, help="seconds before an idle session expires")
    defaults = WorkerLimits()
    for name, (flag, what) in LIMIT_FLAGS.items():
        if name == "max_kv_bytes":
            worker.add_argument(flag, type=float, help=f"{what}, GiB (default: half the memory free at start)")
        else:
            worker.add_argument(flag, type=int, default=getattr(defaults, name), help=f"{what} (default %(default)s)")
    worker.add_argument("--curve-keys", help="folder made by `specbench keys`: CURVE encryption and client auth")
    worker.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without CURVE keys")
    worker.set_defaults(handler=_worker)

    profile = commands.add_parser("profile", help="measure forward latency over a tokens x context grid")
    source = profile.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="catalog name, Hugging Face id or path (measured here)")
    source.add_argument("--worker", help="endpoint of a worker to measure its loaded target on its hardware")
    profile.add_argument("--dtype", default="float32")
    profile.add_argument("--quant", default="none", choices=["none", "8bit", "4bit"])
    profile.add_argument("--self-draft-layers", type=int, help="profile the first N layers of --model")
    profile.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64])
    profile.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    profile.add_argument("--repeats", type=int, default=5)
    profile.add_argument("--out-dir", help="default: the repository's profiles/")
    profile.set_defaults(handler=_profile)

    reference = commands.add_parser("reference", help="record per-step acceptance of a pair on a prompt set")
    reference.add_argument("--target", required=True)
    reference.add_argument("--draft")
    reference.add_argument("--draft-quant", default="none", choices=["none", "8bit", "4bit"])
    reference.add_argument("--self-draft-layers", type=int)
    reference.add_argument("--dataset", default="bench", help="dataset name or a JSONL file of prompts")
    reference.add_argument("--dataset-label", help="name stored in the reference (default: --dataset)")
    reference.add_argument("--prompts", type=int, default=6)
    reference.add_argument("--max-chain", type=int, default=8)
    reference.add_argument("--tree-budgets", type=int, nargs="*", default=[8, 16, 32])
    reference.add_argument("--max-new-tokens", type=int, default=64)
    reference.add_argument("--temperature", type=float, default=0.0)
    reference.add_argument("--rule", default="rejection", choices=["greedy", "rejection", "sample-match"])
    reference.add_argument("--dtype", default="float32")
    reference.add_argument("--out-dir", help="default: the repository's reference/")
    reference.set_defaults(handler=_reference)

    pareto = commands.add_parser("pareto", help="write an HTML latency-cost Pareto report from the caches")
    pareto.add_argument("--out", default="reports/pareto.html")
    pareto.add_argument("--target", help="only references with this target")
    pareto.add_argument("--rtt", type=float, nargs="*", default=[10.0, 50.0, 100.0],
                        help="also predict a remote target at these RTTs (ms)")
    pareto.add_argument("--cs", type=float, default=0.5, help="cost weight in [0, 1]: 0 fastest, 1 cheapest")
    pareto.add_argument("--cost", default="total_cost", choices=["total_cost", "api_cost", "draft_energy",
                                                                 "target_energy"])
    pareto.add_argument("--context", type=int, default=256)
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
    keys.set_defaults(handler=_keys)

    demo = commands.add_parser("demo", help="the main job on the embedded models")
    demo.add_argument("--k", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--dtype", default="float32")
    demo.add_argument("--rtt", type=float, default=50.0, help="emulated RTT for the remote part (ms)")
    demo.add_argument("--out-dir", default="reports", help="where the records CSV and the HTML report go")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except SpecbenchError as error:
        print(f"specbench: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
