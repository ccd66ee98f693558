"""The speculative loop: draft, verify, commit, record. Target-only decoding is the same loop with no drafter."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specbench.decode.drafters import Drafter
from specbench.decode.target import Target
from specbench.types import DraftTree, SamplingParams, SpecbenchError, StepRecord


@dataclass
class Generation:
    prompt_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    prefill_s: float
    records: list[StepRecord]


def generate(target: Target, drafter: Optional[Drafter], prompt_ids: Sequence[int], *, k: int,
             max_new_tokens: int, sampling: SamplingParams, generator: torch.Generator,
             eos_token_ids: Sequence[int] = (), method: str = "", prompt_index: int = 0,
             session: str = "default", proactive: bool = False, planner=None) -> Generation:
    """Generate up to `max_new_tokens` tokens, stopping after an EOS token, drafting `k` per step.

    Tokens past an EOS or past the budget are dropped even when the target accepted them, so the
    output is exactly what target-only decoding would return. Near the end the draft depth is
    capped at remaining - 1 (the bonus token supplies the last one), so no level is wasted; a tree
    keeps its node budget `k`, so its siblings survive the cap.

    With `proactive` (a chain drafter and a target that verifies asynchronously, i.e. remote), the
    drafter keeps drafting past the chain while the verify is in flight; when the verdict accepts
    the whole chain and its bonus token equals the first look-ahead token, the rest of the
    look-ahead opens the next chain, otherwise it is discarded and counted.

    A `planner` (anything with `choose(context_length) -> k` and `observe(drafted, accepted,
    network_s)`, e.g. `specbench.plan.step_planner.StepPlanner`) picks k afresh before every step,
    up to `k`; k = 0 makes that step a plain target step.
    """
    if drafter is not None and k < 1:
        raise SpecbenchError(f"k (draft tokens per step) must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise SpecbenchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = set(eos_token_ids)
    start = time.perf_counter()
    target.prefill(session, prompt_ids)
    prefill_s = time.perf_counter() - start
    proactive = (proactive and getattr(drafter, "supports_lookahead", False)
                 and hasattr(target, "verify_begin"))
    planner = planner if drafter is not None else None  # nothing to plan without a draft
    context, output, records = list(prompt_ids), [], []
    ahead = None  # a look-ahead chain confirmed for the current context
    try:
        while len(output) < max_new_tokens:
            step_start = time.perf_counter()
            depth_cap = max_new_tokens - len(output) - 1
            tree = DraftTree()
            step_k = k if planner is None else min(k, planner.choose(len(context)))
            reused = len(ahead) if ahead is not None and depth_cap > 0 and step_k > 0 else 0
            if drafter is not None and depth_cap > 0 and step_k > 0:
                tree = (drafter.propose(context, step_k, sampling, generator, prefix=ahead, max_depth=depth_cap)
                        if ahead is not None else
                        drafter.propose(context, step_k, sampling, generator, max_depth=depth_cap))
            draft_s = time.perf_counter() - step_start
            step_seed = int(torch.randint(0, 2**62, (), generator=generator))
            looked_ahead, discarded = 0, 0
            if proactive and len(tree) and tree.is_chain:
                pending = target.verify_begin(session, tree, sampling, step_seed)
                ahead = drafter.lookahead(context + list(tree.tokens), step_k + 1, sampling, generator,
                                          keep_going=lambda: not pending.ready())
                verdict = pending.result()
                looked_ahead = len(ahead)
                whole_chain = len(verdict.accepted_path) == len(tree)
                if whole_chain and len(ahead) > 1 and ahead.tokens[0] == verdict.bonus_token:
                    ahead = DraftTree.chain(ahead.tokens[1:], ahead.draft_dists[1:])
                    discarded = 0
                else:
                    discarded, ahead = looked_ahead, None
            else:
                ahead = None
                verdict = target.verify(session, tree, sampling, step_seed)
            if planner is not None:
                planner.observe(len(tree), len(verdict.accepted_path), verdict.network_s)
            emitted = verdict.emitted(tree)
            finished = False
            for cut, token in enumerate(emitted):
                if token in eos:
                    emitted, finished = emitted[:cut + 1], True
                    break
            emitted = emitted[: max_new_tokens - len(output)]
            context += emitted
            output += emitted
            records.append(StepRecord(
                prompt_index=prompt_index, step=len(records), method=method, drafted=len(tree),
                accepted=len(verdict.accepted_path), emitted=len(emitted), draft_s=draft_s,
                verify_s=verdict.verify_s, target_forward_s=verdict.target_forward_s,
                network_s=verdict.network_s, step_s=time.perf_counter() - step_start,
                tree_depth=max(tree.depths(), default=0), accepted_tokens=emitted,
                bonus_token=verdict.bonus_token, bytes_up=verdict.bytes_up, bytes_down=verdict.bytes_down,
                emulated_network_s=verdict.emulated_s, tree_widths=tree.widths(),
                expected_accepted=tree.expected_accepted, lookahead_drafted=looked_ahead,
                lookahead_discarded=discarded, lookahead_reused=reused, budget=step_k if drafter is not None else 0))
            if finished:
                break
    finally:
        target.close(session)
    return Generation(prompt_index, list(prompt_ids), output, prefill_s, records)
