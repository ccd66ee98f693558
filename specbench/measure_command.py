"""`specbench profile` and `specbench reference`: what they measure and where they save it (the parsing is
in `cli.py`)."""
from __future__ import annotations

from specbench.types import SamplingParams, SpecbenchError, default_rule


def profile(args) -> int:
    """Measure forward latency over the grid, locally or on a worker, and save it to the user's profiles."""
    from specbench.plan.library import OWN_PROFILES, save_profile
    from specbench.record import profile_model, profile_worker

    grid = dict(tokens=args.tokens, contexts=args.contexts, repeats=args.repeats, batches=args.batches)
    if args.worker:
        profile, extra = profile_worker(args.worker, **grid)
    elif args.head:  # a draft head's own forward, loaded against its target (--model)
        from specbench.heads.layouts import load_head
        from specbench.heads.profile import head_label, profile_head
        from specbench.models.loading import load_model
        from specbench.models.spec import ModelSpec

        head = load_head(args.head, load_model(ModelSpec(args.model, dtype=args.dtype)))
        profile, extra = profile_head(head, head_label(args.head), tokens=args.tokens, contexts=args.contexts,
                                      repeats=args.repeats, progress=True)
    else:
        from specbench.models.loading import as_loaded
        from specbench.models.spec import ModelSpec

        loaded = as_loaded(ModelSpec(args.model, dtype=args.dtype, quantization=args.quant, kernels=args.kernels),
                           args.dtype)
        if args.self_draft_layers:
            from specbench.models.self_draft import truncated_view

            loaded = truncated_view(loaded, args.self_draft_layers)
        profile, extra = profile_model(loaded, **grid, progress=True, fast=args.fast)
    path = save_profile(profile, extra, folder=args.out_dir or OWN_PROFILES)
    print(f"{profile.model} on {profile.device} ({profile.dtype}): {len(profile.rows)} grid points, repeats spread "
          f"{profile.noise} -> {path}")
    return 0


def reference(args) -> int:
    """Record per-step acceptance of a pair on a prompt set and save it to the user's references."""
    from specbench.models.loading import as_loaded
    from specbench.datasets import load_prompts
    from specbench.models.spec import ModelSpec
    from specbench.plan.library import OWN_REFERENCES, save_reference
    from specbench.plan.predict import FREE_DRAFTS
    from specbench.decode.suffix_drafter import suffix_options
    from specbench.record import record_reference

    target = as_loaded(ModelSpec(args.target, dtype=args.dtype, quantization=args.target_quant), args.dtype)
    if args.self_draft_layers:
        from specbench.models.self_draft import truncated_view

        draft = truncated_view(target, args.self_draft_layers)
    elif args.draft:  # a model, a draft head's folder, or prompt lookup's or suffix decoding's own drafts
        from specbench.heads.profile import is_head

        draft = args.draft if args.draft in FREE_DRAFTS or is_head(args.draft) else as_loaded(
            ModelSpec(args.draft, dtype=args.dtype, quantization=args.draft_quant), args.dtype)
    else:
        raise SpecbenchError("give --draft MODEL or --self-draft-layers N")
    rows = load_prompts(args.dataset, limit=args.prompts)
    prompts = [row["prompt"] for row in rows]
    sampling = SamplingParams(temperature=args.temperature, rule=args.rule or default_rule(args.temperature))
    reference = record_reference(target, draft, prompts, dataset=args.dataset_label or args.dataset,
                                 max_chain=args.max_chain, tree_budgets=args.tree_budgets,
                                 max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 cross_tokenizer=args.cross_tokenizer, families=[row["set"] for row in rows],
                                 hybrid_budgets=args.hybrid, hybrid_method=args.hybrid_method,
                                 hybrid_suffix=suffix_options(args.suffix))
    path = save_reference(reference, {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens},
                          folder=args.out_dir or OWN_REFERENCES)
    print(f"{reference.draft} -> {reference.target} on {reference.dataset}: {len(reference.chain_accepts)} chain "
          f"steps, tree budgets {sorted(reference.tree_accepts)}"
          + (f", {reference.hybrid_method} at {sorted(reference.hybrid_steps)}" if reference.hybrid_steps else "")
          + f" -> {path}")
    return 0
