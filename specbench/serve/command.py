"""`specbench serve`: the command line (parsing and start-up only)."""
from __future__ import annotations

import os

from specbench.types import STOP_BELOW


def add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible endpoint with speculative decoding, a chat page "
                                              "at / and Prometheus metrics at /metrics")
    serve.add_argument("--target", help="catalog name, Hugging Face id or path (or --config; with --worker: that "
                                        "worker's model unless given)")
    serve.add_argument("--config", help="a `specbench tune` configuration (tune.json): its target, method, draft, K "
                                        "and the worker it was measured at (--worker names another)")
    serve.add_argument("--draft", help="draft model for chain and tree methods")
    serve.add_argument("--method", nargs="+", default=None,
                       help="methods a request may pick; the first is the default (default: target-only, plus "
                            "chain with --draft)")
    serve.add_argument("--k", type=int, default=4, help="default K (chain tokens or tree nodes)")
    serve.add_argument("--max-k", type=int, default=8, help="largest K a request may ask for")
    serve.add_argument("--stop-below", type=float, default=STOP_BELOW, metavar="P",
                       help="chain-confident and suffix-tree-chain-confident: end a chain after a token its "
                            "draft gave less than P (default %(default)s)")
    serve.add_argument("--suffix", nargs="+", metavar="KEY=VALUE",
                       help="suffix decoding's settings for the suffix methods, e.g. min_score=2 factor=2 (a request "
                            "may change the step knobs in speculative.suffix; the cache stays the server's)")
    serve.add_argument("--router", help="a router file (`specbench route`): method auto picks each request's method "
                                        "and K from its prompt (offer it with --method auto ...)")
    serve.add_argument("--plan", action="store_true", help="a step planner from the cached profiles picks K per step")
    serve.add_argument("--worker", help="a worker endpoint serving the target, whose model and tokenizer are used "
                                        "(default: a worker started in this process)")
    serve.add_argument("--dtype", help="the target's and draft's dtype (default: a --config's, else float32)")
    serve.add_argument("--device", default="cpu",
                       help="cpu or cuda[:N]: the target (unless --worker) and the draft run there (default cpu)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("SPECBENCH_API_KEY"),
                       help="required as 'Authorization: Bearer KEY' (default: $SPECBENCH_API_KEY, else none)")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback host without an API key")
    for flag, default, what in (("--max-tokens", 512, "largest max_tokens a request may ask for"),
                                ("--max-prompt-tokens", 2048, "longest prompt, tokens"),
                                ("--max-concurrent", 4, "generations at once"),
                                ("--max-queue", 16, "requests waiting beyond those; more get 429"),
                                ("--max-body-bytes", 1 << 20, "largest request body")):
        serve.add_argument(flag, type=int, default=default, help=f"{what} (default %(default)s)")
    serve.set_defaults(handler=_serve)


def settings_from(args):
    from specbench.serve.settings import Limits, ServeSettings
    from specbench.types import SpecbenchError

    target, draft, methods, k, suffix, dtype = args.target, args.draft, args.method, args.k, args.suffix, args.dtype
    worker, extra = args.worker, {}
    if args.config:
        from specbench.tune.report import read_config, suffix_words

        config = read_config(args.config)
        suffix = suffix or suffix_words(config)  # a hybrid's budget for its draft; --suffix overrides
        target, draft, k = config["target"], config.get("draft") or draft, config["k"] or k
        dtype = dtype or config.get("dtype")  # the choice was measured at the tune's dtype
        methods = methods or list(dict.fromkeys([config["method"], "target-only"]))
        extra = {"self_draft_layers": config.get("self_draft_layers"),
                 "substitute_quantization": config.get("substitute_quantization") or "8bit"}
        worker = worker or config.get("endpoint")  # measured through a worker: served through it (--worker: another)
        if config.get("max_new_tokens"):  # requests far from this length are told the choice was not checked there
            extra["tuned"] = (config["method"], int(config["max_new_tokens"]))
    if not target and worker:
        target = worker_model(worker)
    if not target:
        raise SpecbenchError("serve needs --target (or --config from `specbench tune`, or --worker: its model)")
    methods = tuple(methods or (["target-only", "chain"] if draft else ["target-only"]))
    if suffix:
        from specbench.decode.suffix_drafter import SuffixSettings, suffix_options

        extra["suffix"] = SuffixSettings(**suffix_options(suffix))
    limits = Limits(max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
                    max_concurrent=args.max_concurrent, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes)
    settings = ServeSettings(target=target, methods=methods, draft=draft, k=k, max_k=max(args.max_k, k),
                             plan=args.plan, worker=worker, dtype=dtype or "float32", device=args.device,
                             host=args.host, port=args.port,
                             api_key=args.api_key, router=args.router, stop_below=args.stop_below,
                             limits=limits, **extra)
    if args.config:
        from specbench.tune.report import machine_note

        note = machine_note(config.get("machine"), settings.machine)
        if note:  # said once, at start: every request runs on this machine
            print(note[0].upper() + note[1:], flush=True)
    return settings


def worker_model(endpoint: str) -> str:
    """The model a running worker serves, by the name `--target` would give it (its label less quantization
    and kernels, which are the worker's own)."""
    from specbench.models.spec import label_model
    from specbench.worker.client import RemoteTarget

    remote = RemoteTarget(endpoint, timeout_s=30, retries=0)
    try:
        return label_model(remote.info["model"])
    finally:
        remote.disconnect()


def _serve(args) -> int:
    import uvicorn

    from specbench.serve import build_app
    from specbench.types import SpecbenchError

    settings = settings_from(args)
    if not _loopback(settings.host) and not settings.api_key and not args.insecure:
        raise SpecbenchError(f"refusing to listen on {settings.host} without --api-key: anyone who can reach it "
                             f"could use the model. Pass --api-key (or $SPECBENCH_API_KEY), or --insecure")
    app = build_app(settings)
    print(f"serving {settings.target} ({', '.join(settings.methods)}) on http://{settings.host}:{settings.port} "
          f"- chat page at /, OpenAI routes under /v1, metrics at /metrics", flush=True)
    if settings.tuned:  # requests far from this length get a `tune_note` in their usage
        print(f"{settings.tuned[0]} was chosen by a tune on replies of up to {settings.tuned[1]} tokens", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    return 0


def _loopback(host: str) -> bool:
    """The worker's own rule (worker/protocol.py), for an HTTP host."""
    from specbench.worker.protocol import is_local_endpoint

    return is_local_endpoint(f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0")
