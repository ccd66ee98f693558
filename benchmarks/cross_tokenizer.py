"""A draft from another family: specbench's cross-tokenizer chain vs Hugging Face's, side by side.

Same prompts, same run, per dtype: target-only (specbench and HF), HF assisted generation with
`assistant_tokenizer` (its cross-tokenizer path) at K = 2, 4, 6 and its default schedule,
specbench's cross-tokenizer chain (text rule) at K = 2, 4, 6 and dynamic trees of 8 and 16 nodes,
and the same-family draft's chain for comparison. Greedy. Reports tokens/s, tokens per target
step, target tokens per draft token, and whether each output is identical to target-only (a
mismatch is checked teacher-forced and shown as a near-tie when the target's logits of the two tokens there
are within NEAR_TIE_SHARE of their range). Several drafts of other families (`--draft smollm2-135m gemma3-270m`)
run in the same table, each compared with HF's best setting for that draft.

With `--sampled`, sampled rows too (temperature 1, no top-k/top-p, seeded per prompt): target-only,
HF's assisted generation with `do_sample` (its Universal Speculative Decoding path) and specbench's
chain under the shared-vocabulary rejection rule; samples are not compared token for token (the
distribution is tested in tests/test_cross_tokenizer.py).

    python benchmarks/cross_tokenizer.py [--draft smollm2-135m ...] [--dtypes float32 bfloat16] [--ks 2 4 6]
                                         [--tree-budgets 8 16] [--prompts 3] [--max-new-tokens 48]
                                         [--kernels default|onednn] [--sampled] [--rounds 1]
"""
from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
from tqdm.auto import tqdm

from specbench.api import encode_prompts
from specbench.decode.divergence import NEAR_TIE_SHARE
from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.methods import DraftSource, make_drafter
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec
from specbench.models.vocab_bridge import TextBridge
from specbench.types import SamplingParams

from common import RESULTS, bench_prompts, write_report
from local_sd import ForwardTimer, divergence_check

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, rule="rejection")  # the model's own distribution, no top-k/top-p


def hf_generate(target, ids, max_new_tokens, assistant=None, k=None, sampled=False, seed=0):
    """HF generate; with an assistant of another tokenizer, its cross-tokenizer path: text re-tokenized
    and exact match when greedy, Universal Speculative Decoding (shared vocabulary) when sampled."""
    eos = list(target.eos_token_ids)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sampled, eos_token_id=eos,
                  pad_token_id=target.tokenizer.pad_token_id or eos[0])
    if sampled:
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    if assistant is not None:
        config = assistant.model.generation_config
        if k is None:  # HF's defaults (read from a fresh GenerationConfig)
            from transformers import GenerationConfig

            defaults = GenerationConfig()
            config.num_assistant_tokens = defaults.num_assistant_tokens
            config.num_assistant_tokens_schedule = defaults.num_assistant_tokens_schedule
            config.assistant_confidence_threshold = defaults.assistant_confidence_threshold
        else:  # fixed K, the algorithm specbench's chain runs
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
            config.assistant_confidence_threshold = 0.0
        kwargs.update(assistant_model=assistant.model, tokenizer=target.tokenizer,
                      assistant_tokenizer=assistant.tokenizer)
    input_ids = torch.tensor([ids])
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - started


def hf_usd_q_check(target, draft, encoded) -> dict:
    """How far the q that HF's sampled cross-tokenizer path tests each draft token against is from the q
    the token was drawn from, at the first new position of each prompt.

    When sampling across tokenizers, generate prunes the assistant's LM head to the shared tokens, its
    rows in the order of the translator's target->assistant dict (the assistant vocabulary dict's
    order), and writes the pruned logits into target ids in assistant-id order. Where the two orders
    differ, acceptance reads p(x) / q(y) for another token y, so the verdicts are not those of
    rejection sampling and the output is not the target's distribution. Nothing is run through
    generate here: the same two orders are applied to one full forward of the unpruned draft.
    """
    from transformers.generation.candidate_generator import AssistantToTargetTranslator

    vocab = target.model.config.get_text_config().vocab_size  # what generate passes
    translator = AssistantToTargetTranslator(target.tokenizer, draft.tokenizer, vocab)  # no model: no pruning
    pruned_rows = torch.tensor(list(translator.target_to_assistant_input_ids.values()))
    mapped = translator._assistant_to_target_input_ids
    shared = mapped != translator.SUPPRESS_TOKEN_ID
    columns, shared_rows = mapped[shared], torch.nonzero(shared).flatten()
    bridge = TextBridge(draft.tokenizer, target.tokenizer)
    distances = []
    for ids in encoded:
        with torch.inference_mode():
            logits = draft.model(torch.tensor([bridge.to_draft(ids)])).logits[0, -1].float()
        drawn_from, tested_against = (torch.full((vocab,), float("-inf")) for _ in range(2))
        drawn_from[columns] = logits[shared_rows]  # what the pruned head's sample means in target ids
        tested_against[columns] = logits[pruned_rows]  # what the acceptance test reads as q
        distances.append(0.5 * (drawn_from.softmax(-1) - tested_against.softmax(-1)).abs().sum().item())
    import transformers
    return {"transformers": transformers.__version__, "shared_tokens": int(shared.sum()),
            "misplaced_columns": int((pruned_rows != shared_rows).sum()),
            "total_variation_per_prompt": distances}


def specbench_generate(local, drafter, ids, k, max_new_tokens, sampling=GREEDY, seed=0):
    started = time.perf_counter()
    result = generate(local, drafter, ids, Decoding(k, max_new_tokens, sampling), seed=seed)
    wall = time.perf_counter() - started
    drafting = [r for r in result.records if r.drafted]
    return result.output_ids, wall, {
        "steps": len(result.records), "accepted": sum(r.accepted for r in result.records),
        "drafted": sum(r.drafted for r in drafting),
        "draft_tokens": sum((r.draft_tokens if r.draft_tokens is not None else r.drafted) for r in drafting)}


def bench_dtype(dtype, target_name, cross_names, family_name, prompts, max_new_tokens, ks, tree_budgets=(),
                kernels="default", sampled=False, partial=None, rounds=1):
    kernels = kernels if dtype == "float32" else "default"  # oneDNN layers are float32 only
    target = load_model(ModelSpec(target_name, dtype=dtype, kernels=kernels))
    family = load_model(ModelSpec(family_name, dtype=dtype, kernels=kernels)) if family_name else None
    local = LocalTarget(target)
    encoded = encode_prompts(prompts, target.tokenizer)
    timer = ForwardTimer(target.model)
    family_chain = make_drafter("chain", DraftSource(local, target, family, dtype)) if family else None
    methods = [("specbench", "target-only", None, None, None, False), ("hf", "target-only", None, None, None, False)]
    usd_checks = {}
    if sampled:
        methods += [("specbench", "target-only sampled", None, None, None, True),
                    ("hf", "target-only sampled", None, None, None, True)]
    for cross_name in cross_names:  # each draft of another family: HF's cross path and ours, same K
        cross = load_model(ModelSpec(cross_name, dtype=dtype, kernels=kernels))
        cross_chain = make_drafter("chain", DraftSource(local, target, cross, dtype, cross_tokenizer="text"))
        methods += [("hf", f"assisted-cross K={k}", cross_name, cross, k, False) for k in ks]
        methods += [("hf", "assisted-cross default", cross_name, cross, None, False)]
        methods += [("specbench", f"cross-chain K={k}", cross_name, cross_chain, k, False) for k in ks]
        if tree_budgets:  # dynamic trees, each root-to-leaf path re-tokenized, merged into one target trie
            cross_tree = make_drafter("tree", DraftSource(local, target, cross, dtype, cross_tokenizer="text"))
            methods += [("specbench", f"cross-tree {budget}", cross_name, cross_tree, budget, False)
                        for budget in tree_budgets]
        if sampled:  # rejection sampling over the shared vocabulary, both engines
            shared = make_drafter("chain", DraftSource(local, target, cross, dtype, cross_tokenizer="shared-vocab"))
            # HF's USD prunes its assistant's LM head in place (index_select, which oneDNN weights lack):
            # it gets its own copy, on the default kernels
            pruned = load_model(ModelSpec(cross_name, dtype=dtype))
            usd_checks[cross_name] = hf_usd_q_check(target, cross, encoded)
            methods += [("hf", f"assisted-cross sampled K={k}", cross_name, pruned, k, True) for k in ks]
            methods += [("specbench", f"cross-chain sampled K={k}", cross_name, shared, k, True) for k in ks]
    if family_chain:
        methods += [("specbench", "chain K=4", family_name, family_chain, 4, False)]
    rows, outputs = [], {}

    def one(engine, helper, k, sampling, ids, max_new, seed):
        if engine == "hf":
            timer.reset()
            out, wall = hf_generate(target, ids, max_new, helper, k, sampling is SAMPLED, seed)
            return out, wall, {"steps": timer.calls, "accepted": len(out) - timer.calls, "drafted": None,
                               "draft_tokens": None}
        return specbench_generate(local, helper, ids, k or 1, max_new, sampling, seed)

    methods = [(engine, method, draft, helper, k, SAMPLED if sampled else GREEDY)
               for engine, method, draft, helper, k, sampled in methods]
    for engine, _, _, helper, k, sampling in tqdm(methods, desc="warm-up"):
        one(engine, helper, k, sampling, encoded[0], 8, 0)  # discarded
    # prompt-major: every method runs on a prompt before the next prompt, so the VM's drift over minutes
    # falls on all methods alike; each round repeats the whole pass
    bar = tqdm(total=rounds * len(methods) * len(encoded), desc=f"cross-tokenizer {dtype}")
    for round_ in range(rounds):
        for index, ids in enumerate(encoded):
            for engine, method, draft_name, helper, k, sampling in methods:
                out, wall, stats = one(engine, helper, k, sampling, ids, max_new_tokens, index)
                outputs[(engine, method, draft_name, index)] = out
                rows.append({"dtype": dtype, "engine": engine, "method": method, "draft": draft_name,
                             "prompt": index, "round": round_, "sampled": sampling is SAMPLED, "tokens": len(out),
                             "wall_s": wall, **stats})
                bar.update()
            if partial:
                partial(rows)  # after each prompt: a run cut short keeps what it measured
    bar.close()
    timer.remove()
    checks = []
    for (engine, method, draft_name, index), out in outputs.items():
        if "sampled" in method:  # a sample: no single right output (the distribution is tested in tests/)
            continue
        reference = outputs[("specbench", "target-only", None, index)]
        same = out == reference
        checks.append({"dtype": dtype, "engine": engine, "method": method, "draft": draft_name, "prompt": index,
                       "identical": same,
                       "check": None if same else divergence_check(target.model, encoded[index], reference, out)})
    return pd.DataFrame(rows), checks, usd_checks


def summarize(frame: pd.DataFrame, checks) -> pd.DataFrame:
    rows = []
    for (engine, method, draft), group in frame.groupby(["engine", "method", "draft"], sort=False, dropna=False):
        draft = None if pd.isna(draft) else draft
        mine = [c for c in checks if (c["engine"], c["method"], c["draft"]) == (engine, method, draft)]
        drafted = group["drafted"].sum() if group["drafted"].notna().all() else None
        rows.append({"engine": engine, "method": method, "draft": draft,
                     "tokens_per_s": group["tokens"].sum() / group["wall_s"].sum(),
                     "tokens_per_step": group["tokens"].sum() / group["steps"].sum(),
                     "acceptance_rate": group["accepted"].sum() / drafted if drafted else None,
                     "target_per_draft_token": drafted / group["draft_tokens"].sum() if drafted else None,
                     "identical": sum(c["identical"] for c in mine) if mine else None,  # none for samples
                     "near_ties": sum(bool(c["check"] and c["check"]["near_tie"]) for c in mine) if mine else None,
                     "prompts": group["prompt"].nunique(),
                     "tokens_per_s_by_round": [round(r.tokens.sum() / r.wall_s.sum(), 3)
                                               for _, r in group.groupby("round")]})
    table = pd.DataFrame(rows)
    # each row against its own kind: greedy rows against greedy target-only and HF's best greedy cross
    # setting with the same draft, sampled rows against their sampled counterparts
    table["sampled"] = table.method.str.contains("sampled")
    base = {sampled: table[(table.engine == "specbench") & table.method.str.startswith("target-only")
                           & (table.sampled == sampled)]["tokens_per_s"] for sampled in (False, True)}
    hf = table[table.method.str.startswith("assisted-cross")]
    hf_cross = hf.groupby(["draft", "sampled"])["tokens_per_s"].max()
    table["vs_target_only"] = [row.tokens_per_s / base[row.sampled].iloc[0] for row in table.itertuples()]
    table["vs_hf_cross_best"] = [row.tokens_per_s / hf_cross[(row.draft, row.sampled)]
                                 if (row.draft, row.sampled) in hf_cross else None for row in table.itertuples()]
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", nargs="+", default=["smollm2-135m"], help="drafts with another tokenizer")
    parser.add_argument("--family-draft", default="qwen2.5-coder-0.5b", help="same-family draft ('' to skip)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 4, 6])
    parser.add_argument("--tree-budgets", nargs="*", type=int, default=[8, 16],
                        help="node budgets of cross-tokenizer dynamic trees (none: chains only)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--kernels", default="default", choices=["default", "onednn"],
                        help="linear kernels of every model (float32 runs; HF's generate uses the same models)")
    parser.add_argument("--sampled", action="store_true",
                        help="also sampled rows (temperature 1): target-only, HF's USD, specbench's shared-vocab chain")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts (every method per prompt)")
    parser.add_argument("--out", default=str(RESULTS / "cross_tokenizer.json"))
    args = parser.parse_args()
    prompts = bench_prompts(args.prompts)
    pd.set_option("display.width", 200)
    report = {"settings": vars(args), "near_tie_share": NEAR_TIE_SHARE, "dtypes": {}}
    for dtype in args.dtypes:
        frame, checks, usd_checks = bench_dtype(dtype, args.target, args.draft, args.family_draft, prompts,
                                    args.max_new_tokens, args.ks, args.tree_budgets, args.kernels, args.sampled,
                                    partial=lambda rows: write_report(args.out, dict(report, partial=rows)),
                                    rounds=args.rounds)
        table = summarize(frame, checks)
        print(f"\n== {', '.join(args.draft)} drafting for {args.target} ({dtype}, kernels {args.kernels}, "
              f"{len(prompts)} prompts x {args.max_new_tokens} tokens) ==")
        print(table.round(3).to_string(index=False))
        for draft in args.draft:
            for sampled in (False, True) if args.sampled else (False,):
                mine = table[(table.draft == draft) & (table.sampled == sampled)]
                best = mine[mine.method.str.startswith("cross-")].sort_values("tokens_per_s").iloc[-1]
                print(f"goals, {draft}{' sampled' if sampled else ''}: specbench best cross ({best.method}) / HF best "
                      f"cross = {best.vs_hf_cross_best:.2f} (>= 1.0), / target-only = {best.vs_target_only:.2f} (>= 1.25)")
        for check in checks:
            if not check["identical"]:
                print(f"  mismatch {check['engine']}/{check['method']}/{check['draft']} prompt {check['prompt']}: {check['check']}")
        for draft, usd in usd_checks.items():
            tv = usd["total_variation_per_prompt"]
            print(f"HF's sampled cross-tokenizer path with {draft} (transformers {usd['transformers']}): "
                  f"{usd['misplaced_columns']} of {usd['shared_tokens']} pruned-head columns land on another token's "
                  f"id; total variation between the q it tests against and the q it draws from: "
                  f"{min(tv):.2f}-{max(tv):.2f} over {len(tv)} prompts (0 = lossless). Its sampled rows are "
                  f"{'not ' if usd['misplaced_columns'] else ''}a lossless baseline.")
        report["dtypes"][dtype] = {"summary": table.to_dict("records"), "checks": checks, "hf_usd_check": usd_checks,
                                   "per_prompt": frame.to_dict("records")}
        write_report(args.out, report)  # after each dtype, so a cut-short run keeps what it measured


if __name__ == "__main__":
    main()
