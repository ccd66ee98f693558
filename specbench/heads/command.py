"""`specbench train-draft`: the command line of head training (parsing and dispatch only)."""
from __future__ import annotations


def add_train_draft(commands) -> None:
    from specbench.heads.layouts import LAYOUTS
    from specbench.heads.train import INITS, TrainSpec
    from specbench.models.spec import KERNELS, KERNELS_HELP

    defaults = TrainSpec(target="")
    train = commands.add_parser("train-draft", help="train an EAGLE-3-style draft head for a target on a prompt set "
                                                    "(resumable); run it with --method eagle --draft <out>/head")
    train.add_argument("--target", required=True, help="catalog name, Hugging Face id or path")
    train.add_argument("--prompts", default=defaults.prompts,
                       help="a dataset name or a JSONL path (default %(default)s)")
    train.add_argument("--prompt-count", type=int, default=defaults.prompt_count)
    train.add_argument("--held-out", type=int, default=defaults.held_out,
                       help="prompts kept out of training, for the acceptance shown while training")
    train.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                       help="tokens of each target response trained on")
    train.add_argument("--max-length", type=int, default=defaults.max_length)
    train.add_argument("--samples", type=int, default=defaults.samples,
                       help="target responses per prompt: the greedy one, then sampled ones (default %(default)s)")
    train.add_argument("--temperature", type=float, default=defaults.temperature,
                       help="of the sampled responses (default %(default)s)")
    train.add_argument("--teacher-forced", action="store_true", help="train on the prompts' text, no responses")
    train.add_argument("--repeat-spans", type=float, default=defaults.repeat_spans, metavar="SHARE",
                       help="this share of the sequences gets one of its own spans (24-64 tokens of its reply or "
                            "prompt) appended again, so the head learns the target's copying (default: none)")
    train.add_argument("--labels", choices=("soft", "greedy"), default=defaults.labels,
                       help="the target's top-k distribution per position (soft) or its argmax (greedy)")
    train.add_argument("--feature-loss", type=float, default=defaults.feature_loss, metavar="WEIGHT",
                       help="also pull the head's state towards the target's final hidden state at the position it "
                            "predicts (EAGLE-1's regression), with this weight beside the labels' (default: off)")
    train.add_argument("--loss-on", choices=("reply", "all"), default=defaults.loss_on,
                       help="positions trained to predict: after the prompt, where drafting proposes (reply), or "
                            "every one (all: the prompt's text too)")
    train.add_argument("--own-embeddings", action="store_true",
                       help="write a copy of the target's embeddings with the head (to draft on a worker's client)")
    train.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab)
    train.add_argument("--layers", type=int, nargs="+", metavar="LAYER",
                       help="the target layers whose inputs the head fuses (default: EAGLE-3's 2, L/2 and L-3; "
                            "L: the final hidden state)")
    train.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps, help="training-time-test unroll")
    train.add_argument("--epochs", type=float, default=defaults.epochs)
    train.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    train.add_argument("--batch", type=int, default=defaults.batch)
    train.add_argument("--minutes", type=float, help="stop training after this long (the checkpoint is kept)")
    train.add_argument("--layout", choices=LAYOUTS, default=defaults.layout)
    train.add_argument("--distil", type=int, metavar="LAYERS",
                       help="instead of a head, distil a draft model of the target's first LAYERS layers "
                            "(written to <out>/draft; run it with --method chain --draft <out>/draft)")
    train.add_argument("--init", choices=INITS, default=defaults.init,
                       help="the head's start: the target's output rows and final norm (output), and also the target "
                            "layer that reads the high feature, passed through (layer)")
    train.add_argument("--dtype", default=defaults.dtype)
    train.add_argument("--kernels", default=defaults.kernels, choices=list(KERNELS),
                       help=KERNELS_HELP + " (the target's, for its replies and feature passes)")
    train.add_argument("--out", required=True, help="folder: data, checkpoint, and the head in <out>/head; a rerun "
                                                    "there resumes")
    train.set_defaults(handler=_train_draft)


def _train_draft(args) -> int:
    from specbench.heads.train import TrainSpec, train_head

    spec = TrainSpec(target=args.target, prompts=args.prompts, prompt_count=args.prompt_count, held_out=args.held_out,
                     max_new_tokens=args.max_new_tokens, max_length=args.max_length,
                     samples=args.samples, temperature=args.temperature, teacher_forced=args.teacher_forced,
                     repeat_spans=args.repeat_spans, labels=args.labels, loss_on=args.loss_on,
                     feature_loss=args.feature_loss, own_embeddings=args.own_embeddings,
                     draft_vocab=args.draft_vocab, layers=tuple(args.layers) if args.layers else None,
                     ttt_steps=args.ttt_steps, epochs=args.epochs,
                     learning_rate=args.learning_rate, batch=args.batch, minutes=args.minutes, layout=args.layout,
                     dtype=args.dtype, kernels=args.kernels, init=args.init)
    if args.distil:
        from specbench.heads.distil import distil_draft

        result = distil_draft(spec, args.distil, args.out)
        print(f"draft written to {result.folder / 'draft'}: {result.data['sequences']} sequences, "
              f"{result.data['tokens']} tokens, {args.distil} layers, step {result.data['steps']} of "
              f"{result.data['total_steps']}{_final_loss(result)}; seconds {result.seconds}")
        return 0
    result = train_head(spec, args.out)
    last = result.history.dropna(subset=["held_out_tokens_per_step"]).tail(1) if "held_out_tokens_per_step" in \
        result.history else result.history.tail(0)
    print(f"head written to {result.folder / 'head'} ({spec.layout} layout): {result.data['sequences']} sequences, "
          f"{result.data['tokens']} tokens, draft vocabulary {result.data['draft_vocab']}, step "
          f"{result.data['steps']} of {result.data['total_steps']}{_final_loss(result)}"
          + (f", held-out tokens per step {float(last['held_out_tokens_per_step'].iloc[0]):.2f}" if len(last) else "")
          + f"; seconds {result.seconds}")
    return 0


def _final_loss(result) -> str:
    """The last step's loss; or, where --minutes ran out before a first step (the target's replies and features
    took them, and are cached), what to do: the written weights are the untrained start."""
    if "loss_0" in result.history and len(result.history):
        return f", final loss {result.history['loss_0'].iloc[-1]:.3f}"
    return (" - no training step within --minutes (the target's replies and features took them; they are cached, "
            "so a rerun with the same settings trains): the weights written are untrained")
