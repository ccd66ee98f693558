"""Which draft pays depends on the prompt: fixed methods, suffix decoding and a per-prompt router, per family.

One run. Requests: Spec-Bench's 13 families (its question file, by path), and multi-turn sessions whose
later requests repeat earlier outputs (the project's `agentic` set: self-refinement, code edits, tool
calls; and ShareGPT conversations), scripted with the target's own greedy answers. Each family's
prompts are split: the router trains on the calibration half (every candidate run over it, interleaved) and is judged
on the held-out half, where every candidate, `auto`, and the per-prompt oracle (the best candidate for
each prompt, from those same runs) are compared. When each candidate is its own method (K may differ), a pass
is one `run` call: every prompt runs every method and `auto` back to back, their order rotated per prompt, so a
slow spell of the machine falls on all of them alike (timed one call per method, a slow spell once made `auto`
3x slower than the method it chose on the same steps: 2026-12-02-workload-qwen-amx-two-passes.md). With one
method at two Ks (prompt-lookup:4 and :8), held-out runs go family by family, one call per method, their order
reversed every other family. Either way each suffix method has its own cache, which sees only that method's
earlier requests. Knobs chosen by replay (`--suffix-min-score`, `--hand-over`, `--catch-up auto`) are read off the
calibration run; the candidates they change are then calibrated again at the chosen values before the router is
fitted, so it learns them as they run held out.

The oracle takes, per prompt, the fastest of several timings, so timing noise alone lifts it above every
method it picks from. `--passes 2` times the held-out half twice (the second pass in the reverse order,
each suffix method with a fresh cache) and adds the cross-fitted oracle: each prompt's method chosen on one
pass and timed on the other, what a perfect per-prompt choice would earn without the winner's luck.

    python benchmarks/workload.py --spec-bench ~/.cache/specbench/datasets/spec-bench/question.jsonl
    python benchmarks/workload.py --spec-bench ... --dtype bfloat16    # the target in bf16
    python benchmarks/workload.py --spec-bench ... --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
        --candidates target-only suffix-tree:16 chain:3   # a model draft of the target's family as a candidate
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from specbench.api import encode_prompts, outputs, run
from specbench.datasets import load_prompts
from specbench.datasets.loaders import load_conversations
from specbench.datasets.sessions import script_sessions
from specbench.decode.divergence import divergence
from specbench.decode.suffix_drafter import SuffixSettings
from specbench.decode.target import LocalTarget
from specbench.methods import get_method
from specbench.models.loading import load_model
from specbench.models.spec import KERNELS, KERNELS_HELP, ModelSpec
from specbench.route.auto import calibrate, calibration_seen, candidates_from, drafts_with_a_model
from specbench.route.router import LEARN, MARGIN, fit_router, parse_margin, rows_of
from specbench.route.hand_over import choose_catch_up, choose_hand_over
from specbench.route.suffix_floor import choose_min_score

from common import RESULTS, write_report

MULTI_TURN = ("self-refine", "code-edit", "tool-call", "sharegpt-multiturn")
DRIFT = 1.02  # target-only's pace moving more than this between passes is reported as the box's drift


def requests(args, target) -> list[dict]:
    """Every request {session, set, turn, ids}: scripted sessions, then Spec-Bench's sampled per family."""
    rows = [row for row in load_prompts("agentic")
            if args.sessions is None or int(row["id"].rsplit("-", 1)[1]) < args.sessions]
    if args.sharegpt_sessions:
        for number, messages in enumerate(load_conversations("sharegpt", limit=args.sharegpt_sessions * 4, seed=1)):
            turns = [m["content"][:1200] for m in messages if m["role"] == "user" and m["content"].strip()][:3]
            if len(turns) >= 2 and sum(r["set"] == "sharegpt-multiturn" for r in rows) < args.sharegpt_sessions:
                rows.append({"id": f"sharegpt-{number}", "set": "sharegpt-multiturn", "turns": turns})
    found = script_sessions(target, rows, max_new_tokens=args.max_new_tokens)
    if args.spec_bench:
        by_family = defaultdict(list)
        for row in load_prompts(args.spec_bench):
            by_family[row["set"]].append(row)
        for family, members in sorted(by_family.items()):
            chosen = random.Random(0).sample(members, min(args.per_family, len(members)))
            for row, ids in zip(chosen, encode_prompts([r["prompt"] for r in chosen], target.tokenizer)):
                found.append({"session": f"spec-bench-{row['id']}", "set": family, "turn": 0, "ids": ids})
    return found


def split(found: list[dict]) -> tuple[list[dict], list[dict]]:
    """Calibration and held-out halves: alternate sessions within each family (a session's turns stay together)."""
    order = defaultdict(dict)
    for request in found:
        order[request["set"]].setdefault(request["session"], len(order[request["set"]]))
    calibration = [r for r in found if order[r["set"]][r["session"]] % 2 == 0]
    held = [r for r in found if order[r["set"]][r["session"]] % 2 == 1]
    return calibration, held


def prompt_names(prompts: list[dict]) -> list[str]:
    """Each request's name in the report, "family/i": its place among its family's requests in `prompts`."""
    seen: dict = defaultdict(int)
    names = []
    for request in prompts:
        names.append(f"{request['set']}/{seen[request['set']]}")
        seen[request["set"]] += 1
    return names


def per_prompt(records: pd.DataFrame) -> pd.DataFrame:
    """Tokens and seconds (prefill + steps, and the router's own time under auto) per (method, prompt)."""
    grouped = records.groupby(["method", "prompt_index"])
    table = grouped.agg(tokens=("emitted", "sum"), steps=("emitted", "size"), verified=("drafted", "sum"),
                        step_s=("step_s", "sum"), prefill_s=("prefill_s", "first"))
    table["verified"] += table["steps"]  # each step verifies its drafts and the bonus position
    table["route_s"] = grouped["route_s"].first() if "route_s" in records else 0.0
    table["route_s"] = table["route_s"].fillna(0.0)
    table["seconds"] = table["step_s"] + table["prefill_s"] + table["route_s"]
    return table.reset_index()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--spec-bench", help="Spec-Bench's data/spec_bench/question.jsonl (13 families)")
    parser.add_argument("--per-family", type=int, default=4, help="Spec-Bench prompts per family")
    parser.add_argument("--sessions", type=int, help="agentic sessions per family (default: all)")
    parser.add_argument("--sharegpt-sessions", type=int, default=6)
    parser.add_argument("--stop-below", type=float, default=0.4,
                        help="chain-confident candidates: end a chain after a token the draft gave less than this")
    parser.add_argument("--candidates", nargs="+",
                        default=["target-only", "prompt-lookup:4", "suffix:16", "suffix-tree:16", "chain:4"],
                        help="METHOD[:K][@DRAFT] each: a draft after '@' is that candidate's own (loaded at "
                             "--draft-dtype), else --draft")
    parser.add_argument("--draft-quant", default="int8-dynamic", help="chain candidates' draft: the target at this "
                                                              "quantization (the substitute draft), loaded once")
    parser.add_argument("--draft", help="chain and tree candidates' draft: this model (e.g. qwen2.5-coder-0.5b for "
                                        "qwen2.5-coder-1.5b), in the target's dtype and kernels, in place of "
                                        "--draft-quant's substitute")
    parser.add_argument("--head", help="a trained draft head's folder: the draft of `eagle`, `eagle-tree` and "
                                       "`suffix-eagle` candidates (then no chain or tree candidate: one draft per run)")
    parser.add_argument("--suffix-factor", type=float, default=SuffixSettings.factor,
                        help="suffix methods draft up to factor x matched tokens + offset "
                             "(a cheap wide verify pays more)")
    parser.add_argument("--suffix-offset", type=float, default=SuffixSettings.offset)
    parser.add_argument("--suffix-min-prob", type=float, default=SuffixSettings.min_prob,
                        help="suffix methods draft no token whose estimated probability is under this "
                             "(a dear wide verify wants it higher)")
    parser.add_argument("--suffix-min-score", type=float_or_auto, default=SuffixSettings.min_score,
                        help="suffix methods draft nothing on a step whose proposal expects fewer accepted tokens "
                             "(where a verify of 2 tokens costs much more than 1: float32 on an AVX2 CPU); 'auto': "
                             "calibrate at 0, then the held-out runs take the floor `route.suffix_floor` picks from "
                             "the calibration run (needs target-only among the candidates)")
    parser.add_argument("--hand-over", type=float_or_auto, default=SuffixSettings.hand_over,
                        help="hybrid candidates (suffix-eagle, suffix-chain): the head or draft model drafts a step "
                             "whose suffix proposal expects fewer accepted tokens than this; 'auto' (suffix-chain "
                             "candidates): calibrate at the default, then the held-out runs take the hand-over "
                             "`route.hand_over` picks from the calibration run (after the floor)")
    parser.add_argument("--catch-up", type=float_or_auto, default=SuffixSettings.catch_up,
                        help="suffix-chain candidates: the draft model drafts only while what it must read first is "
                             "at most this many times the tokens the request may still emit (inf: always); 'auto': "
                             "calibrate at inf, then the held-out runs take the catch-up `route.hand_over` picks "
                             "from the calibration run (after the hand-over)")
    parser.add_argument("--other-k", type=int, default=SuffixSettings.other_k,
                        help="hybrid candidates: the head's or draft model's budget on the steps it drafts")
    parser.add_argument("--trust", type=float, default=SuffixSettings.trust,
                        help="hybrid candidates: suffix decoding's record a request starts with (its scores scaled "
                             "by (accepted + trust) / (expected + trust) there; inf: scores as they are)")
    parser.add_argument("--bench-below", type=float, default=SuffixSettings.bench_below,
                        help="hybrid candidates: a request benches the head or draft model once its steps there gain "
                             "fewer accepted tokens a step than this (0: never; unset: 0.3 behind a head, 0 behind a "
                             "draft model)")
    parser.add_argument("--margin", type=parse_margin, default=None, help="the router leaves its default candidate "
                        f"only for one predicted better by more than this share ({LEARN}: cross-validated, the "
                        f"default from 10 calibration prompts, {MARGIN} below)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--kernels", default="default", choices=list(KERNELS), help=KERNELS_HELP)
    parser.add_argument("--dtype", default="float32", help="the target's (bfloat16 on a CPU with AVX-512 bf16: a "
                        "verify of 16 tokens then costs about 1.4x one token's, in float32 2x)")
    parser.add_argument("--draft-dtype", help="--draft's dtype (default: --dtype). On an AMX CPU a bf16 target's "
                        "wide verify is all but free while a small bf16 draft's one-row forwards run slower than in "
                        "float32 (benchmarks/results/2026-12-02-demo-amx.md)")
    parser.add_argument("--passes", type=int, default=1, choices=(1, 2),
                        help="time the held-out half this many times (2: the cross-fitted oracle, see above)")
    parser.add_argument("--out", default=str(RESULTS / "workload.json"))
    args = parser.parse_args()

    started = time.perf_counter()
    loaded = load_model(ModelSpec(args.target, dtype=args.dtype, kernels=args.kernels))
    target = LocalTarget(loaded)
    candidates = candidates_from(args.candidates)
    models = any(drafts_with_a_model(c) and c.draft is None for c in candidates)  # drafting with --draft
    if args.head and models:
        raise SystemExit("--head drafts the eagle candidates; chain, tree and suffix-chain candidates would need "
                         "another draft")
    if args.draft and not models:
        raise SystemExit("--draft is the draft of chain, tree and suffix-chain candidates: add one to --candidates")
    own = {c.draft for c in candidates if c.draft and drafts_with_a_model(c)}  # "chain:4@NAME": their own drafts
    if args.draft_dtype and not (args.draft or own):
        raise SystemExit("--draft-dtype is the draft models' dtype: name a draft model (--draft, or METHOD:K@DRAFT)")
    drafts = {name: load_model(ModelSpec(name, dtype=args.draft_dtype or args.dtype, kernels=args.kernels))
              for name in sorted(own)}
    draft = args.head
    if models:
        draft = load_model(ModelSpec(args.draft, dtype=args.draft_dtype or args.dtype, kernels=args.kernels)
                           if args.draft else ModelSpec(args.target, quantization=args.draft_quant))
    found = requests(args, target)
    scripted_s = time.perf_counter() - started
    calibration, held = split(found)
    if not calibration or not held:
        raise SystemExit(f"{len(found)} requests split into {len(calibration)} calibration and {len(held)} held-out "
                         f"ones: alternate sessions go to each half, so ask for at least 2 (--sessions, --per-family)")
    print(f"{len(found)} requests ({len(calibration)} calibration, {len(held)} held out) in "
          f"{len(set(r['set'] for r in found))} families; scripted in {scripted_s:.0f} s")

    if args.suffix_min_score == "auto" and "target-only" not in args.candidates:
        raise SystemExit("--suffix-min-score auto replays the target's own outputs: add target-only to --candidates")
    hybrids = [c for c in candidates if c.method in ("suffix-chain", "suffix-tree-chain")]
    if "auto" in (args.hand_over, args.catch_up) and not (hybrids and "target-only" in args.candidates
                                         and any(c.method == "chain" for c in candidates) and args.draft):
        raise SystemExit("--hand-over auto and --catch-up auto replay the calibration: they need target-only, chain "
                         "and suffix-chain or suffix-tree-chain among --candidates, and --draft (an unquantized model)")
    chosen = {"min_score": 0.0 if args.suffix_min_score == "auto" else args.suffix_min_score,  # auto: chosen below
              "hand_over": SuffixSettings.hand_over if args.hand_over == "auto" else args.hand_over,
              "catch_up": SuffixSettings.catch_up if args.catch_up == "auto" else args.catch_up}
    first = dict(chosen)  # the knobs the calibration runs at
    replays = {}  # knob -> the replay table it was chosen from

    def settings(cache):
        return SuffixSettings(name=cache, factor=args.suffix_factor, offset=args.suffix_offset,
                              min_prob=args.suffix_min_prob, min_score=chosen["min_score"],
                              hand_over=chosen["hand_over"], other_k=args.other_k, catch_up=chosen["catch_up"],
                              trust=args.trust, bench_below=args.bench_below)

    def one(method, k, prompts, families, cache, **extra):
        return run(target, [r["ids"] for r in prompts], method=method, k=k, draft=draft, drafts=drafts,
                   max_new_tokens=args.max_new_tokens, warmup=False, progress=False, families=families,
                   suffix=settings(cache), stop_below=args.stop_below, **extra)

    # warm every candidate once (its cache a throwaway one), then calibrate the router
    for c in candidates:
        one(c.spec, c.k, calibration[:1], None, "warm")
    calibration_records = calibrate(target, [r["ids"] for r in calibration], candidates, draft=draft, drafts=drafts,
                                    max_new_tokens=args.max_new_tokens, warmup=False, progress=False,
                                    suffix=settings("calibration "), stop_below=args.stop_below)  # interleaved
    if "target-only" in args.candidates:  # the calibration prompts with the target's own outputs, for replays
        produced = outputs(calibration_records[calibration_records["method"] == "target-only"])
        Path(args.out).with_suffix(".calibration.json").write_text(json.dumps(
            [dict(r, output=produced[("target-only", i)]) for i, r in enumerate(calibration)]))
        prompts = [r["ids"] for r in calibration]
        answers = [produced[("target-only", i)] for i in range(len(calibration))]
        if args.suffix_min_score == "auto":
            chosen["min_score"], floors = choose_min_score(
                prompts, answers, calibration_records, settings("replay"),
                k=max((c.k for c in candidates if c.method == "suffix"), default=16))
            print(f"suffix floor from the calibration run: min_score {chosen['min_score']} "
                  f"({floors.attrs['step_cost']})\n{floors.round(3).to_string(index=False)}")
        for knob, choose in (("hand_over", choose_hand_over), ("catch_up", choose_catch_up)):  # in that order
            if getattr(args, knob) == "auto":
                chosen[knob], replays[knob] = choose(
                    prompts, answers, calibration_records, draft, settings("replay"), k=max(c.k for c in hybrids),
                    tree=any(c.method == "suffix-tree-chain" for c in hybrids), max_new_tokens=args.max_new_tokens)
                print(f"{knob.replace('_', '-')} from the calibration run: {chosen[knob]}\n"
                      f"{replays[knob].round(3).to_string(index=False)}")
    again = [c for c in candidates if _knobs_touch(c, {knob for knob in chosen if chosen[knob] != first[knob]})]
    if again:  # the router learns these candidates as they run held out: at the chosen knobs, not the defaults
        print(f"calibrating {[c.label for c in again]} again at {chosen} (the replays chose knobs they read)")
        rerun = calibrate(target, [r["ids"] for r in calibration], again, draft=draft, drafts=drafts,
                          max_new_tokens=args.max_new_tokens, warmup=False, progress=False,
                          suffix=settings("calibration again "), stop_below=args.stop_below)
        stale = [index for c in again for index in rows_of(calibration_records, c).index]
        calibration_records = pd.concat([calibration_records.drop(index=stale), rerun], ignore_index=True)
    for c in candidates:
        records = rows_of(calibration_records, c)
        print(f"calibration {c.label}: {records['emitted'].sum() / records['step_s'].sum():.2f} tok/s (steps)")
    calibration_records.to_pickle(Path(args.out).with_suffix(".calibration-records.pkl"))  # for re-fits
    prompts = [r["ids"] for r in calibration]
    router = fit_router(calibration_records, prompts, candidates, [r["set"] for r in calibration],
                        margin=args.margin, seen=calibration_seen(calibration_records, prompts, candidates,
                                                                  settings("calibration ")))
    router.reply_tokens = args.max_new_tokens  # as `train_router` records it: a later use at another length is told
    router.save(Path(args.out).with_suffix(".router.json"))
    print(f"router: default {router.default}, margin {router.margin}"
          + (f" (cross-validated tok/s by margin: {router.margins})" if router.margins else ""))
    print(f"router: family defaults {'used' if router.by_family else 'not used'}: {router.family_defaults}"
          + (f" (cross-validated tok/s by margin with them: {router.family_margins})" if router.family_margins else ""))

    rows, made = [], {}  # made: each held-out run's output, (label, pass, prompt) -> ids
    families = sorted(set(r["set"] for r in held), key=lambda f: (f not in MULTI_TURN, f))
    # the held-out requests under the rows' prompt names; kept beside the report, so a router fitted anew on the
    # calibration records can be scored on these rows without scripting the sessions again
    ordered = [r for family in families for r in held if r["set"] == family]  # the held-out half, family by family
    named = dict(zip(prompt_names(ordered), ordered))
    Path(args.out).with_suffix(".held-out.json").write_text(json.dumps(named))

    def keep(records, label_of, prompts, turn):
        """The per-prompt rows and outputs of held-out `records` (`label_of`: a row's method -> its label)."""
        names = prompt_names(prompts)
        for (method, index), produced in outputs(records).items():
            made[(label_of[method], turn, names[index])] = produced
        for item in per_prompt(records).itertuples():
            label = label_of[item.method]
            rows.append({"family": prompts[item.prompt_index]["set"], "label": label,
                         "prompt": names[item.prompt_index], "pass": turn, "tokens": item.tokens,
                         "seconds": item.seconds, "route_s": item.route_s, "steps": item.steps,
                         "verified": item.verified,
                         "chosen": (records[(records.method == "auto") & (records.prompt_index == item.prompt_index)]
                                    ["chosen"].iloc[0] if item.method == "auto" else label)})

    # one call per pass when each candidate is its own method: every prompt runs every method back to back (run
    # rotates their order per prompt), so a slow spell of the machine falls on all of them alike; each method's
    # suffix cache sees the pass's earlier prompts, as the named caches of one call per method did
    together = len({c.recorded for c in candidates}) == len(candidates)
    for turn in range(args.passes):
        if together:
            prompts = ordered
            methods = [c.spec for c in candidates] + ["auto"]
            records = one(methods if turn % 2 == 0 else methods[::-1], 4, prompts, [r["set"] for r in prompts],
                          f"held-out pass {turn}", router=router)
            keep(records, {**{c.recorded: c.label for c in candidates}, "auto": "auto"}, prompts, turn)
            print(f"held out, pass {turn + 1}/{args.passes}: done ({len(prompts)} prompts, methods interleaved)")
            continue
        for number, family in enumerate(families):
            prompts = [r for r in held if r["set"] == family]
            order = [(c.spec, c.recorded, c.label) for c in candidates] + [("auto", "auto", "auto")]
            for method, recorded, label in (order if (number + turn) % 2 == 0 else order[::-1]):
                records = one(method, 4, prompts, [family] * len(prompts), f"held-out {label} pass {turn}",
                              **({"router": router} if method == "auto" else {}))
                keep(records, {recorded: label}, prompts, turn)
            print(f"held out {family}, pass {turn + 1}/{args.passes}: done ({len(prompts)} prompts)")
    report = summarise(pd.DataFrame(rows), [c.label for c in candidates])
    report["outputs_unlike_target_only"] = unlike_target_only(
        made, loaded.model, {name: request["ids"] for name, request in named.items()})
    print(f"held-out outputs unlike target-only's, per method, and how many of them part at a near-tie of the "
          f"target's logits: {report['outputs_unlike_target_only']}")
    report.update({"args": vars(args), "requests": len(found), "calibration": len(calibration), "held_out": len(held),
                   "seconds": round(time.perf_counter() - started, 1), "router_default": router.default,
                   "router_margin": str(router.margin), "suffix_min_score": chosen["min_score"],
                   "hand_over": chosen["hand_over"], "catch_up": chosen["catch_up"],
                   "calibrated_again": [c.label for c in again],
                   **{f"{knob}s": table.to_dict("records") for knob, table in replays.items()},
                   **({"suffix_floors": floors.to_dict("records")} if args.suffix_min_score == "auto" else {}),
                   "router_margins": {str(m): v for m, v in router.margins.items()},
                   "router_by_family": router.by_family, "router_family_defaults": router.family_defaults,
                   "router_family_margins": {str(m): v for m, v in router.family_margins.items()},
                   "router_features": json.loads(Path(args.out).with_suffix(".router.json").read_text())["features"]})
    write_report(args.out, report)


def unlike_target_only(made: dict, model, prompt_ids: dict) -> dict:
    """Per label, how many held-out outputs differ from target-only's on the same prompt and pass (greedy SD is
    lossless: 0 in float32 but for near-ties of the target's logits across verify widths), how many of them part
    at a near-tie of the target's (`model`'s) logits, and every one that does not (a defect); {} without
    target-only."""
    if not any(label == "target-only" for label, _, _ in made):
        return {}
    found, ties, defects = defaultdict(int), defaultdict(int), []
    for (label, turn, prompt), produced in made.items():
        check = divergence(model, prompt_ids[prompt], made[("target-only", turn, prompt)], produced)
        found[label] += check is not None  # every label counted, 0 where nothing differs
        if check is None:
            continue
        ties[label] += bool(check.near_tie)
        if not check.near_tie:
            defects.append({"label": label, "pass": turn, "prompt": prompt, **asdict(check)})
    return {"differ": dict(found), "near_ties": dict(ties), "not_near_ties": defects}


def _knobs_touch(candidate, knobs: set) -> bool:
    """Whether changing these suffix knobs changes how `candidate` drafts: the floor (`min_score`) every suffix
    method's, the hand-over and catch-up the hybrids' (a model or head drafts their weak steps)."""
    method = get_method(candidate.method)
    if not method.keeps_outputs:
        return False
    return "min_score" in knobs or (not method.lookup and bool(knobs & {"hand_over", "catch_up"}))


def float_or_auto(text: str) -> float | str:
    return "auto" if text == "auto" else float(text)


def oracles(rows: pd.DataFrame, fixed: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the oracle: per prompt and pass, the fixed candidate fastest on that pass; the cross-fitted oracle:
    each pass's rows of the candidate fastest on the other pass, empty with one pass)."""
    timed = rows[rows.label.isin(fixed)].assign(speed=lambda d: d.tokens / d.seconds)
    best = timed.sort_values("speed").groupby(["prompt", "pass"]).tail(1)
    if timed["pass"].nunique() < 2:
        return best, best.iloc[0:0]
    other = best.assign(**{"pass": 1 - best["pass"]})[["prompt", "pass", "label"]]
    return best, timed.merge(other, on=["prompt", "pass", "label"])


def summarise(rows: pd.DataFrame, fixed: list[str]) -> dict:
    """Per family and overall (every pass pooled): tok/s of each candidate, auto and the oracles; the goals'
    ratios."""
    best_per_prompt, crossed = oracles(rows, fixed)
    table = []
    for family, members in list(rows.groupby("family")) + [("all", rows)]:
        line = {"family": family, "prompts": members["prompt"].nunique(), **_speeds(members)}
        oracle = best_per_prompt[best_per_prompt.prompt.isin(members.prompt)]
        line["oracle"] = oracle.tokens.sum() / oracle.seconds.sum()
        if len(crossed):
            chunk = crossed[crossed.prompt.isin(members.prompt)]
            line["oracle cross-fitted"] = chunk.tokens.sum() / chunk.seconds.sum()
        for label, chunk in members.groupby("label"):  # tokens per step: exact under greedy, no timing noise in it
            line[f"{label} tok/step"] = chunk.tokens.sum() / chunk.steps.sum()
        line["best fixed"] = max(fixed, key=lambda label: line.get(label, 0.0))
        table.append(line)
    frame = pd.DataFrame(table)
    print(frame.round(2).to_string(index=False))
    overall = frame[frame.family == "all"].iloc[0]
    multi = rows[rows.family.isin(MULTI_TURN)]
    speed = _speeds(multi)
    by_pass = {str(turn): _speeds(chunk) for turn, chunk in rows.groupby("pass")}
    auto = rows[rows.label == "auto"]
    goals = {
        **{f"multi_turn_{name}_over_lookup": speed[label] / speed["prompt-lookup k=4"]  # only where both ran
           for name, label in (("suffix", "suffix k=16"), ("suffix_tree", "suffix-tree k=16"))
           if label in speed and "prompt-lookup k=4" in speed},
        "auto_over_best_fixed": overall["auto"] / overall[overall["best fixed"]],
        "auto_over_oracle": overall["auto"] / overall["oracle"],
        **({"auto_over_cross_fitted_oracle": overall["auto"] / overall["oracle cross-fitted"],
            "cross_fitted_oracle_over_best_fixed": overall["oracle cross-fitted"] / overall[overall["best fixed"]],
            "oracle_over_best_fixed": overall["oracle"] / overall[overall["best fixed"]],
            "best_fixed_by_pass": {turn: max(fixed, key=lambda label: pace.get(label, 0.0))
                                   for turn, pace in by_pass.items()},
            "auto_over_best_fixed_by_pass": {turn: pace.get("auto", 0.0) / max(pace.get(label, 0.0)
                                                                              for label in fixed)
                                             for turn, pace in by_pass.items()}}
           if len(crossed) else {}),
        **({"target_only_by_pass": {turn: pace["target-only"] for turn, pace in by_pass.items()}}
           if len(by_pass) > 1 and all("target-only" in pace for pace in by_pass.values()) else {}),
        "router_share_of_time": auto.route_s.sum() / auto.seconds.sum(),
        "auto_choices": auto.groupby("chosen").prompt.nunique().to_dict(),
        "oracle_choices": best_per_prompt.groupby("label").prompt.nunique().to_dict(),
        **({"oracle_choices_agree_across_passes": float(
            (best_per_prompt.pivot(index="prompt", columns="pass", values="label").nunique(axis=1) == 1).mean())}
           if len(crossed) else {}),
    }
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in goals.items()}, indent=1))
    paces = list(goals.get("target_only_by_pass", {}).values())
    if paces and max(paces) > DRIFT * min(paces):  # target-only's steps are the same each pass: only the box moved
        print(f"note: target-only ran {min(paces):.2f}-{max(paces):.2f} tok/s across the passes, a "
              f"{max(paces) / min(paces) - 1:.1%} drift of the box; methods compare within a pass (interleaved per "
              f"prompt), and a ratio across passes moves by as much")
    return {"table": table, "goals": goals, "rows": rows.to_dict("records")}


def _speeds(rows: pd.DataFrame) -> dict[str, float]:
    """tok/s of each label over `rows` (tokens over seconds, pooled: long prompts weigh as they take)."""
    return {label: chunk.tokens.sum() / chunk.seconds.sum() for label, chunk in rows.groupby("label")}


if __name__ == "__main__":
    main()
