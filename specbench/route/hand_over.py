"""A hybrid's hand-over (`SuffixSettings.hand_over`) chosen from a calibration run instead of by hand.

Why: `suffix-chain` and `suffix-tree-chain` hand a step to the draft model when suffix decoding expects fewer
than `hand_over` accepted tokens. Where the model's chain accepts well (the 0.5B for the 1.5B Qwen: 3.2 tokens a
step), a weak suffix match is worth less than the model's draft, and the default 1.0 keeps too many of them. Under
greedy decoding the choice is read off one calibration run, as the floor is (`route.suffix_floor`): the target's
own outputs replay each hand-over exactly (suffix decoding's proposals depend on the context and its cache, an
unquantized draft's on the prefix: one teacher-forced forward a prompt, `tune.replay.model_proposer`), priced by
the step cost fitted on the run's records plus the model's drafting seconds a step and its seconds for each token
it must read first (its chain's, as measured: `draft_prices`; a prompt's read was once spread over every step).
Example: a step where suffix decoding expects 1.4 tokens goes to suffix decoding at hand_over 1.0 and to the
model at 2.0 (its expectation first scaled by its record in the request, as the hybrid scales it:
`SuffixSettings.trust`). The catch-up (`SuffixSettings.catch_up`: how much the draft may have to read first,
against the tokens still to emit) is chosen the same way, its reads priced at the seconds a token the chain's
first step of each prompt spent reading it (`draft_prices`).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch

from specbench.decode.hybrid_drafter import bench, record_scale
from specbench.decode.kv import common_prefix
from specbench.decode.suffix_drafter import SuffixDrafter, SuffixSettings
from specbench.route.suffix_floor import StepCost, choose_fastest, fit_step_cost
from specbench.tune.replay import chain_accepted, model_proposer, tree_accepted
from specbench.types import SamplingParams, SpecbenchError

HAND_OVERS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
CATCH_UPS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, math.inf)


def replay_hand_overs(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], draft,
                      settings: SuffixSettings, cost: StepCost, model_step_s: float, k: int = 16, tree: bool = True,
                      hand_overs: Sequence[float] = HAND_OVERS, catch_ups: Optional[Sequence[float]] = None,
                      read_s: float = 0.0, max_new_tokens: Optional[int] = None) -> pd.DataFrame:
    """One row per hand-over (or, given `catch_ups`, per catch-up at `settings.hand_over`): the greedy hybrid
    run's steps, tokens verified, steps the model drafted and tokens it read first on `prompts` with the
    target's own `outputs` (one suffix drafter fed them in order, as a run's is; the draft's cache followed as
    a run's `ModelDrafter` keeps it), priced at `cost` plus `model_step_s` a model step and `read_s` a token it
    read beyond a step's usual two. `draft`: an unquantized model of the target's vocabulary. `max_new_tokens`:
    the run's limit (the catch-up compares with the tokens still allowed; None: each output's own length).
    Steps and tokens are the run's exactly; verified tokens a little under where an output ended at EOS before
    the run's limit (the run's last steps draft their whole budget there: 965 against 982 on the Qwen pair's
    calibration)."""
    if len(prompts) != len(outputs) or not prompts:
        raise SpecbenchError(f"need one output per prompt, got {len(prompts)} prompts and {len(outputs)} outputs")
    if getattr(getattr(draft, "spec", None), "quantization", "none") != "none":
        raise SpecbenchError("a quantized draft's proposals depend on how its forwards group the rows: "
                             "replay the hand-over with an unquantized draft")
    fulls = [list(prompt) + list(output) for prompt, output in zip(prompts, outputs)]
    proposers = [model_proposer(full, draft) for full in fulls]  # one forward a prompt serves every hand-over
    grid = [(hand_over, settings.catch_up) for hand_over in hand_overs] if catch_ups is None else \
        [(settings.hand_over, catch_up) for catch_up in catch_ups]
    bench_below = settings.bench_for(head=False)  # the replay's drafter is a draft model
    rows = []
    for hand_over, catch_up in grid:
        suffix = SuffixDrafter(replace(settings, cache="drafter"), tree=tree)
        steps = verified = tokens = model_steps = drafting = read = 0
        cached: list[int] = []  # what the draft's cache holds, as `ModelDrafter` keeps it
        for full, start, propose in zip(fulls, (len(p) for p in prompts), proposers):
            position, limit = start, start + (max_new_tokens or len(full) - start)
            record = [0.0, 0]  # suffix decoding's expected and accepted tokens in this request (`HybridDrafter`)
            other = [0, 0]  # the draft's steps and accepted tokens there
            while position < len(full):
                budget = min(k, len(full) - position - 1)
                accepted = width = 0
                if budget >= 1:
                    found = suffix.propose(full[:position], budget, SamplingParams(), torch.Generator(),
                                           max_depth=budget)
                    pending = position - min(common_prefix(cached, full[:position]), position - 1)
                    expected = found.expected_accepted or 0.0
                    if (len(found) and expected * record_scale(*record, settings.trust) >= hand_over) \
                            or pending > catch_up * (limit - position) or bench(*other, bench_below):
                        accepted, width = (tree_accepted(found, full[position:]), len(found)) if len(found) else (0, 0)
                        if len(found):
                            record = [record[0] + expected, record[1] + accepted]
                    else:
                        chain = list(propose(position, min(settings.other_k, budget)))
                        accepted, width = chain_accepted(chain, full[position:]), len(chain)
                        other = [other[0] + 1, other[1] + accepted]
                        cached = full[:position] + chain[:-1]  # it fed the context, then each token but the last
                        model_steps, read = model_steps + 1, read + max(0, pending - 2)
                steps, verified, position = steps + 1, verified + 1 + width, position + accepted + 1
                drafting += width > 0
            tokens += len(full) - start
            suffix.finish(full)
        seconds = cost.seconds(steps, verified, drafting) + model_steps * model_step_s + read * read_s
        rows.append({"hand_over": float(hand_over), "catch_up": float(catch_up), "steps": steps, "tokens": tokens,
                     "verified": verified, "model_steps": model_steps, "read": read,
                     "tokens_per_step": tokens / steps, "priced_tokens_per_s": tokens / seconds})
    return pd.DataFrame(rows)


def draft_prices(records: pd.DataFrame, prompt_lengths: Sequence[int]) -> tuple[float, float]:
    """(seconds of a model step, seconds a token the draft reads first) from a calibration run's `chain` rows:
    its median drafting seconds a step (a step reads one or two tokens), and per prompt its first drafting
    step's excess over that median (the step that read the whole prompt) over the prompt's length, the median
    of those. The 0.5B Qwen on 2 CPU cores: 0.45 s a step, 5 ms a token read."""
    chain = records[(records["method"] == "chain") & (records["drafted"] > 0)]
    if chain.empty:
        raise SpecbenchError("pricing the draft's steps needs the draft model's own chain among the "
                             "calibration candidates (its drafting seconds a step)")
    step_s = float(chain["draft_s"].median())
    first = chain.sort_values("step").groupby("prompt_index")["draft_s"].first()
    reads = [(seconds - step_s) / prompt_lengths[index] for index, seconds in first.items()
             if 0 <= index < len(prompt_lengths) and prompt_lengths[index] > 2]
    return step_s, max(0.0, float(np.median(reads))) if reads else 0.0


def choose_hand_over(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], records: pd.DataFrame,
                     draft, settings: SuffixSettings = SuffixSettings(), k: int = 16, tree: bool = True,
                     hand_overs: Sequence[float] = HAND_OVERS,
                     max_new_tokens: Optional[int] = None) -> tuple[float, pd.DataFrame]:
    """The hand-over whose replay is priced fastest (the lowest of equals) and the table it was chosen from.
    `records`: the calibration run's step records, with target-only's and a lookup's steps (the step cost) and a
    model chain's (`chain`: its drafting seconds a step and a token read, `draft_prices`)."""
    return _choose("hand_over", prompts, outputs, records, draft, settings, k, tree, max_new_tokens,
                   hand_overs=hand_overs)


def choose_catch_up(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], records: pd.DataFrame,
                    draft, settings: SuffixSettings = SuffixSettings(), k: int = 16, tree: bool = True,
                    catch_ups: Sequence[float] = CATCH_UPS,
                    max_new_tokens: Optional[int] = None) -> tuple[float, pd.DataFrame]:
    """The catch-up (at `settings.hand_over`) whose replay is priced fastest, the lowest of equals, as
    `choose_hand_over` picks the hand-over."""
    return _choose("catch_up", prompts, outputs, records, draft, settings, k, tree, max_new_tokens,
                   catch_ups=catch_ups)


def _choose(column: str, prompts, outputs, records: pd.DataFrame, draft, settings: SuffixSettings, k: int,
            tree: bool, max_new_tokens: Optional[int], **grid) -> tuple[float, pd.DataFrame]:
    """The replay of `grid` priced from `records`, and the value of `column` it prices fastest."""
    cost = fit_step_cost(records)
    step_s, read_s = draft_prices(records, [len(p) for p in prompts])
    table = replay_hand_overs(prompts, outputs, draft, settings, cost, step_s, k, tree, read_s=read_s,
                              max_new_tokens=max_new_tokens, **grid)
    return choose_fastest(table, column, cost), table
