"""Acceptance on the held-back prompts, replayed from their target-only greedy outputs.

Why: under greedy decoding, SD emits the target's own tokens, so how many drafts a step accepts depends
on the target's output alone. A prompt-lookup draft proposes from the context; a model draft with the
target's tokenizer proposes its argmax, which, as long as it agrees, is its argmax over the target's
own prefix: one teacher-forced forward of the draft over prompt + output gives every step's proposal.
So the target-only run that tune measures anyway (to calibrate speed) also gives each draft's acceptance
on exactly the prompts measured, without running SD. Acceptance recorded on other prompts (the
calibration split) shifts with the prompts: 20 prompts predicted 20 others' prompt lookup 32% off in
the 2026-11-25 fidelity run. Sampled rules, trees and drafts with another tokenizer keep the
calibration reference.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from specbench.types import SamplingParams

Proposer = Callable[[int, int], Sequence[int]]  # (position of the next token, budget) -> proposed tokens


def chain_steps(full: Sequence[int], start: int, propose: Proposer, k: int) -> list[tuple[int, int, int]]:
    """(budget, drafted, accepted) of each step of greedy chain SD at K over `full` (prompt + the target's
    output, the output from `start`); the budget is K, or less where the output ends (the loop drafts at most
    what remains less the bonus token). A reference keeps the steps that drafted K (`record_reference`)."""
    steps, position = [], start
    while position < len(full):
        budget = min(k, len(full) - position - 1)
        proposal = list(propose(position, budget)) if budget >= 1 else []
        accepted = chain_accepted(proposal, full[position:])
        steps.append((budget, len(proposal), accepted))
        position += accepted + 1
    return steps


def chain_accepted(proposal: Sequence[int], actual: Sequence[int]) -> int:
    """How many of a chain's tokens greedy verification accepts: its prefix that the target's own
    continuation `actual` repeats (proposal [5, 7, 9] against actual [5, 7, 2, ...]: 2)."""
    accepted = 0
    while accepted < len(proposal) and accepted < len(actual) and proposal[accepted] == actual[accepted]:
        accepted += 1
    return accepted


def tree_accepted(tree, actual: Sequence[int]) -> int:
    """How deep the path of `tree` that the target's own continuation `actual` follows goes (greedy acceptance
    of a tree: a chain's `chain_accepted`)."""
    return tree.followed(actual)


def drafter_proposer(full: Sequence[int], drafter) -> Proposer:
    """A drafter's own proposal at each step, on the context so far: prompt lookup's, or a quantized
    model's (`ModelDrafter`), whose argmaxes depend on how its forwards group the rows (int8-dynamic's
    per-tensor activation scale, 8-bit's outlier columns): fed as SD feeds it (the prompt less what its
    cache kept from the prompt before, then a step's drafts and catch-ups), it proposes what SD's drafter
    proposed. On the 2-core VM of 2026-11-26 the int8-dynamic substitute's one teacher-forced forward
    predicted 1.41 accepted per full K=6 step on humaneval where SD accepted 3.39."""
    generator = torch.Generator().manual_seed(0)
    return lambda position, budget: drafter.propose(list(full[:position]), budget, SamplingParams(),
                                                    generator).tokens


@torch.inference_mode()
def model_proposer(full: Sequence[int], draft) -> Proposer:
    """An unquantized model draft's greedy proposals at each position, from one teacher-forced forward over
    `full` (its rows do not change one another's argmax)."""
    device = draft.model.get_input_embeddings().weight.device
    logits = draft.model(input_ids=torch.tensor([list(full)], device=device)).logits[0]
    guesses = logits.argmax(-1).tolist()  # guesses[t]: the draft's next token after full[:t + 1]
    return lambda position, budget: guesses[position - 1:position - 1 + budget]


def held_back_reference(reference, prompts_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                        new_drafter: Optional[Callable[[], object]] = None, draft=None, ks: Sequence[int] = ()):
    """`reference` with its chain acceptance replaced by the held-back prompts' own, replayed from the
    target-only outputs: by drafters of `new_drafter` (prompt lookup, suffix decoding: one per K, fed the
    prompts in order as a run's one drafter is, its cache taking each output as the run's does), else by
    `draft`, a model with the target's tokenizer (a quantized one: its own drafter per K, fed as SD feeds
    it). Every step of a run at each K of `ks` is kept (`steps_at_k`: partial drafts and each output's
    capped last steps included), besides the full steps at the reference's K. None where it cannot be
    replayed (no chain steps in the reference, another tokenizer, a sampled rule)."""
    if not reference.has_chains or reference.cross_tokenizer or reference.rule != "greedy":
        return None
    from specbench.decode.drafters import ModelDrafter

    lookup, k = new_drafter is not None, reference.max_chain
    quantized = not lookup and getattr(draft.spec, "quantization", "none") != "none"
    steps = {size: [] for size in ({k} if quantized else {k, *ks})}  # a quantized draft's drafting costs time:
    if quantized:  # its own drafter, at the reference's K only (a smaller K derives from it, `steps_at`)
        new_drafter = lambda: ModelDrafter(draft, draft.vocab_size)  # noqa: E731
    drafters = {size: new_drafter() for size in steps} if new_drafter is not None else {}
    owners = {size: [] for size in steps}  # the held-back prompt of each step
    for index, (prompt, output) in enumerate(zip(prompts_ids, outputs)):
        full = list(prompt) + list(output)
        forced = model_proposer(full, draft) if not drafters else None  # one forward serves every K
        for size in steps:
            found = chain_steps(full, len(prompt), forced or drafter_proposer(full, drafters[size]), size)
            steps[size] += found
            owners[size] += [index] * len(found)
            if hasattr(drafters.get(size), "finish"):  # suffix decoding's cache takes the output, as a run's does
                drafters[size].finish(full)
    accepts = [accepted for _, drafted, accepted in steps[k] if drafted == k]  # full steps at the reference's K
    if not accepts and not any(steps.values()):
        return None
    asked = {size: [drafted == size for budget, drafted, _ in found if budget == size] for size, found in steps.items()}
    hits = {size: round(sum(found) / len(found), 4) for size, found in asked.items() if found and lookup}
    return replace(reference, chain_accepts=tuple(accepts), chain_hits=hits or reference.chain_hits,
                   steps_at_k={size: tuple((d, a) for _, d, a in found) for size, found in steps.items() if found}
                   or reference.steps_at_k, steps_prompts={size: tuple(owners[size]) for size in steps if steps[size]},
                   dataset=f"{reference.dataset} -> held-back replay")


def drafting_steps(draft, prompts_ids: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int,
                   min_steps: int = 12):
    """A model draft's own drafting at K, timed as SD's drafter runs it over the held-back prompts' target
    outputs (greedy: the steps SD would take), prompt after prompt until `min_steps` steps: one row per step
    with `drafted`, `accepted` and `draft_s`, as a run's records have them. Why: a draft's cost in the loop
    (its cache, one output row, its distribution) is not its profiled forward's (the int8-dynamic
    substitute drafted at 1.22-1.25x its re-timed 1-token forward on 2026-11-26), and a tune's first point
    of a draft has no run of that draft to learn it from."""
    import time

    import pandas as pd

    from specbench.decode.drafters import ModelDrafter

    drafter, rows = ModelDrafter(draft, draft.vocab_size), []
    for prompt, output in zip(prompts_ids, outputs):
        full, seconds = list(prompt) + list(output), []
        propose = drafter_proposer(full, drafter)

        def timed(position: int, budget: int) -> Sequence[int]:
            started = time.perf_counter()
            tokens = propose(position, budget)
            seconds.append(time.perf_counter() - started)
            return tokens

        steps = chain_steps(full, len(prompt), timed, k)
        rows += [{"drafted": drafted, "accepted": accepted, "draft_s": spent}
                 for (_, drafted, accepted), spent in zip(steps, seconds) if drafted]
        if len(rows) >= min_steps:
            break
    return pd.DataFrame(rows, columns=["drafted", "accepted", "draft_s"])
