"""The `specbench` command: models, run, and the main job (`demo`)."""
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
    records = run(target, args.prompt or DEMO_PROMPTS, method=args.method, draft=draft, k=args.k,
                  max_new_tokens=args.max_new_tokens, sampling=sampling, dtype=args.dtype)
    print(summarize(records).round(3).to_string(index=False))
    if args.out:
        records.to_csv(args.out, index=False)
        print(f"per-step records: {args.out}")
    return 0


def _demo(args) -> int:
    """The main job: embedded SmolLM2, target-only vs every lossless method, one table."""
    from specbench.api import outputs, run
    from specbench.decode.metrics import summarize
    from specbench.models.spec import ModelSpec

    print("specbench demo: SmolLM2-135M-Instruct (embedded), greedy, CPU", flush=True)
    target = ModelSpec("smollm2-135m", dtype=args.dtype)
    methods = ["target-only", "prompt-lookup", "self-draft", "substitute"]
    records = run(target, DEMO_PROMPTS, method=methods, k=args.k, max_new_tokens=args.max_new_tokens, self_draft_layers=26, dtype=args.dtype)
    produced = outputs(records)
    table = summarize(records)
    table["identical_to_target_only"] = [
        all(produced[(method, i)] == produced[("target-only", i)] for i in range(len(DEMO_PROMPTS)))
        for method in table["method"]]
    print(table.round(3).to_string(index=False))
    print("\n(self-draft = SmolLM2's first 26 of 30 layers; substitute = its own 8-bit twin as the draft)")
    return 0


def _worker(args) -> int:
    import logging
    from datetime import datetime

    from specbench.models.spec import ModelSpec
    from specbench.worker.server import Worker, WorkerConfig

    def log(line: str) -> None:
        print(f"{datetime.now().isoformat(timespec='seconds')} {line}", flush=True)

    logging.getLogger("transformers").setLevel(logging.ERROR)
    spec = lambda name: ModelSpec(name, dtype=args.dtype, device=args.device, quantization=args.quant) if name else None
    config = WorkerConfig(bind=args.bind, model=spec(args.model),
                          draft=ModelSpec(args.draft, dtype=args.dtype, device=args.device) if args.draft else None,
                          lazy=args.lazy, max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout,
                          max_kv_bytes=int(args.max_kv_gib * 2**30) if args.max_kv_gib else None,
                          curve_keys=args.curve_keys, insecure=args.insecure)
    Worker(config, log=log).serve()
    return 0


def _keys(args) -> int:
    """Create a CURVE key pair for the worker and one for a client, in the layout both expect."""
    from pathlib import Path

    import zmq.auth

    folder = Path(args.folder)
    (folder / "clients").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(folder, "server")
    zmq.auth.create_certificates(folder, "client")
    (folder / "clients" / "client.key").write_bytes((folder / "client.key").read_bytes())
    print(f"worker: --curve-keys {folder}  (clients allowed: {folder / 'clients'}/*.key)")
    print(f"client: RemoteTarget(..., curve_keys='{folder}')  (needs server.key and client.key_secret)")
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    run_parser.set_defaults(handler=_run)

    worker = commands.add_parser("worker", help="serve a target model over ZeroMQ (Ctrl-C stops it)")
    worker.add_argument("--bind", default="tcp://127.0.0.1:5555")
    worker.add_argument("--model", help="catalog name, Hugging Face id or path")
    worker.add_argument("--draft", help="draft model for the server-only baseline")
    worker.add_argument("--quant", default="none", choices=["none", "8bit", "4bit"])
    worker.add_argument("--dtype", default="float32")
    worker.add_argument("--device", default="cpu")
    worker.add_argument("--lazy", action="store_true", help="load the model on first use, not at start")
    worker.add_argument("--max-sessions", type=int, default=64)
    worker.add_argument("--idle-timeout", type=float, default=900.0, help="seconds before an idle session expires")
    worker.add_argument("--max-kv-gib", type=float, help="refuse new prefills beyond this much KV cache")
    worker.add_argument("--curve-keys", help="folder made by `specbench keys`: CURVE encryption and client auth")
    worker.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without CURVE keys")
    worker.set_defaults(handler=_worker)

    keys = commands.add_parser("keys", help="create CURVE keys for a worker and a client")
    keys.add_argument("folder")
    keys.set_defaults(handler=_keys)

    demo = commands.add_parser("demo", help="the main job on the embedded models")
    demo.add_argument("--k", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--dtype", default="float32")
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
