"""Replaying a measured run's steps on a latency profile: what the run would do on a target shared by several
clients, or on other hardware, with its acceptance and its client's own time as measured."""
from __future__ import annotations

from statistics import mean
from typing import Sequence

from specbench.plan.predict import HostCost, LatencyProfile
from specbench.types import SpecbenchError


def replay_speed(records, prompt_lengths: Sequence[int], target: LatencyProfile, clients: int = 1,
                 network_s: float = 0.0, packed: bool = True, prefills: bool = False,
                 host: HostCost = HostCost()) -> float:
    """Per-client tokens/s predicted for a measured run (a records frame, any number of prompts) replayed
    on a target shared by `clients`: each step's verify priced by the profile's batch grid at its
    context and at its batch's width, the client's own time (drafting, loop) as measured, plus
    `network_s` per step. The width: for a packed batch (`LocalTarget.packed`, most models) the mean
    row, since its linears see the rows' tokens and nothing else: (the step's own 1 + drafted + the
    other clients' mean row, from the run's own step sizes) / clients; for a padded one its longest
    row (the step's own, or the longest of the other clients' rows). Why: methods without a draft
    profile (prompt lookup) still get a concurrency forecast, ragged rows included. `prefills`: the
    clients decode prompt after prompt (steady load), so per prompt a client also waits for its own
    prefill and, on average, each other client's one (compute-bound, each blocks the target about as
    long as alone: the `prefill_s` measured), plus a round trip to open the session and one to close it.
    `host`: the worker's own work per round of `clients` rows, added to every step."""
    if prefills and "prefill_s" not in records:
        raise SpecbenchError("prefills=True needs the records' prefill_s (a run's records carry it)")
    sizes = (1 + records["drafted"]).astype(int)
    if packed:
        others_mean = float(sizes.mean())
        widths = lambda own: [((own + (clients - 1) * others_mean) / clients, 1.0)]  # noqa: E731
    else:
        longest = _longest_of(sizes.value_counts(normalize=True).sort_index(), clients - 1)
        widths = lambda own: [(max(own, width), p) for width, p in longest.items()]  # noqa: E731
    seconds, tokens = 0.0, 0
    for _, steps in records.groupby("prompt_index", sort=False):
        context = prompt_lengths[int(steps["prompt_index"].iloc[0])]
        for step in steps.sort_values("step").itertuples():
            verify_s = sum(p * target.forward_s(width, context, clients) for width, p in widths(1 + int(step.drafted)))
            seconds += verify_s + step.draft_s + step.overhead_s + network_s + host.at(clients)
            context += step.emitted
            tokens += step.emitted
        if prefills:
            seconds += clients * float(steps["prefill_s"].iloc[0]) + 2 * network_s
    return tokens / seconds if seconds else 0.0


def replay_together(records, prompt_lengths: Sequence[int], target: LatencyProfile, network_s: float = 0.0,
                    packed: bool = True, host: HostCost = HostCost(), alone_verifies: bool = False) -> float:
    """Aggregate tokens/s predicted for the records' prompts decoded at once by as many clients on one
    shared target, each client replaying its own prompt's measured steps: in rounds, every client
    still decoding sends its next step, one forward verifies them all (priced like `replay_speed`'s
    batches: the rows' mean width when packed, the longest when padded, at the rows' mean context),
    and a round lasts the slowest client's own time + `network_s` + that forward. Why next to
    `replay_speed`'s steady state: a run that starts clients together ends with a tail where the
    clients that accept more have finished, so its last batches are part-full. The prompts'
    prefills (`prefill_s` as measured, where recorded) are added one after another: compute-bound,
    they gain little from sharing a forward, and they weigh more in a run that decodes faster. `host`:
    the worker's own work per round, at the round's rows. `alone_verifies`: the records are a run through
    the same worker, one client at a time, so each step's server time as measured (`queue_s` + `verify_s`)
    is kept with its lone forward swapped for the batched one (profile at the round's rows minus profile
    alone); pass `host.beyond_one()`, since those steps already hold a one-row round's own work."""
    steps = {index: list(group.sort_values("step").itertuples())
             for index, group in records.groupby("prompt_index", sort=False)}
    context = {index: prompt_lengths[int(index)] for index in steps}
    seconds = sum(float(queue[0].prefill_s) for queue in steps.values()) if "prefill_s" in records else 0.0
    tokens, round_index = 0, 0
    while True:
        rows = [(index, queue[round_index]) for index, queue in steps.items() if round_index < len(queue)]
        if not rows:
            break
        sizes = [1 + int(step.drafted) for _, step in rows]
        width = sum(sizes) / len(sizes) if packed else max(sizes)
        mean_context = round(mean(context[index] for index, _ in rows))
        measured = max(step.queue_s + step.verify_s - target.forward_s(1 + int(step.drafted), context[index], 1)
                       for index, step in rows) if alone_verifies else 0.0
        seconds += (max(step.draft_s + step.overhead_s for _, step in rows) + network_s + measured
                    + target.forward_s(width, mean_context, len(rows)) + host.at(len(rows)))
        for index, step in rows:
            context[index] += step.emitted
            tokens += step.emitted
        round_index += 1
    return tokens / seconds if seconds else 0.0


def _longest_of(pmf, draws: int) -> dict[int, float]:
    """Distribution of the largest of `draws` independent draws from `pmf` ({size: probability});
    no draws: {0: 1.0}. Example: sizes 1 and 5 at 2/3 and 1/3, two draws: {1: 4/9, 5: 5/9}."""
    if draws <= 0:
        return {0: 1.0}
    below, result = 0.0, {}
    for size, p in pmf.items():
        result[int(size)] = (below + p) ** draws - below ** draws
        below += p
    return result
