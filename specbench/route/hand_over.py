"""A hybrid's hand-over (`SuffixSettings.hand_over`) chosen from a calibration run instead of by hand.

Why: `suffix-chain` and `suffix-tree-chain` hand a step to the draft model when suffix decoding expects fewer
than `hand_over` accepted tokens. Where the model's chain accepts well (the 0.5B for the 1.5B Qwen: 3.2 tokens a
step), a weak suffix match is worth less than the model's draft, and the default 1.0 keeps too many of them. Under
greedy decoding the choice is read off one calibration run, as the floor is (`route.suffix_floor`): the target's
own outputs replay each hand-over exactly (suffix decoding's proposals depend on the context and its cache, an
unquantized draft's on the prefix: one teacher-forced forward a prompt, `tune.replay.model_proposer`), priced by
the step cost fitted on the run's records plus the model's drafting seconds a step (its chain's, as measured).
Example: a step where suffix decoding expects 1.4 tokens goes to suffix decoding at hand_over 1.0 and to the
model at 2.0.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import pandas as pd
import torch

from specbench.decode.suffix_drafter import SuffixDrafter, SuffixSettings
from specbench.route.suffix_floor import StepCost, choose_fastest, fit_step_cost
from specbench.tune.replay import chain_accepted, model_proposer, tree_accepted
from specbench.types import SamplingParams, SpecbenchError

HAND_OVERS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


def replay_hand_overs(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], draft,
                      settings: SuffixSettings, cost: StepCost, model_step_s: float, k: int = 16, tree: bool = True,
                      hand_overs: Sequence[float] = HAND_OVERS) -> pd.DataFrame:
    """One row per hand-over: the greedy hybrid run's steps, tokens verified and steps the model drafted on
    `prompts` with the target's own `outputs` (one suffix drafter fed them in order, as a run's is), priced at
    `cost` plus `model_step_s` a model step. `draft`: an unquantized model of the target's vocabulary. Steps and
    tokens are the run's exactly; verified tokens a little under where an output ended at EOS before the run's
    limit (the run's last steps draft their whole budget there: 965 against 982 on the Qwen pair's calibration)."""
    if len(prompts) != len(outputs) or not prompts:
        raise SpecbenchError(f"need one output per prompt, got {len(prompts)} prompts and {len(outputs)} outputs")
    if getattr(getattr(draft, "spec", None), "quantization", "none") != "none":
        raise SpecbenchError("a quantized draft's proposals depend on how its forwards group the rows: "
                             "replay the hand-over with an unquantized draft")
    fulls = [list(prompt) + list(output) for prompt, output in zip(prompts, outputs)]
    proposers = [model_proposer(full, draft) for full in fulls]  # one forward a prompt serves every hand-over
    rows = []
    for hand_over in hand_overs:
        suffix = SuffixDrafter(replace(settings, cache="drafter"), tree=tree)
        steps = verified = tokens = model_steps = drafting = 0
        for full, start, propose in zip(fulls, (len(p) for p in prompts), proposers):
            position = start
            while position < len(full):
                budget = min(k, len(full) - position - 1)
                accepted = width = 0
                if budget >= 1:
                    found = suffix.propose(full[:position], budget, SamplingParams(), torch.Generator(),
                                           max_depth=budget)
                    if len(found) and (found.expected_accepted or 0.0) >= hand_over:
                        accepted, width = tree_accepted(found, full[position:]), len(found)
                    else:
                        chain = list(propose(position, min(settings.other_k, budget)))
                        accepted, width = chain_accepted(chain, full[position:]), len(chain)
                        model_steps += 1
                steps, verified, position = steps + 1, verified + 1 + width, position + accepted + 1
                drafting += width > 0
            tokens += len(full) - start
            suffix.finish(full)
        seconds = cost.seconds(steps, verified, drafting) + model_steps * model_step_s
        rows.append({"hand_over": float(hand_over), "steps": steps, "tokens": tokens, "verified": verified,
                     "model_steps": model_steps, "tokens_per_step": tokens / steps,
                     "priced_tokens_per_s": tokens / seconds})
    return pd.DataFrame(rows)


def choose_hand_over(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], records: pd.DataFrame,
                     draft, settings: SuffixSettings = SuffixSettings(), k: int = 16, tree: bool = True,
                     hand_overs: Sequence[float] = HAND_OVERS) -> tuple[float, pd.DataFrame]:
    """The hand-over whose replay is priced fastest (the lowest of equals) and the table it was chosen from.
    `records`: the calibration run's step records, with target-only's and a lookup's steps (the step cost) and a
    model chain's (`chain`: its drafting seconds a step)."""
    chain = records[(records["method"] == "chain") & (records["drafted"] > 0)]
    if chain.empty:
        raise SpecbenchError("choosing the hand-over needs the draft model's own chain among the calibration "
                             "candidates (its drafting seconds a step)")
    cost = fit_step_cost(records)
    table = replay_hand_overs(prompts, outputs, draft, settings, cost, float(chain["draft_s"].mean()), k, tree,
                              hand_overs)
    return choose_fastest(table, "hand_over", cost), table
