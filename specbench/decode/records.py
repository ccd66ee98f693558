"""The one place a StepRecord is built: from a step, what it emitted, and how long it took."""
from __future__ import annotations

from specbench.decode.step import Step
from specbench.types import StepRecord


def record_step(step: Step, emitted: list[int], *, prompt_index: int, index: int, method: str, kind: str,
                planned: bool, step_k: int, step_s: float) -> StepRecord:
    """`overhead_s` is defined here and nowhere else: the step's time not spent drafting, queued on a
    shared worker, verifying (target side) or on the network."""
    timing, tree = step.verdict.timing, step.tree
    return StepRecord(
        prompt_index=prompt_index, step=index, method=method, kind=kind, planned=planned, step_k=step_k,
        drafted=len(tree), accepted=len(step.verdict.accepted_path), emitted=len(emitted),
        emitted_tokens=list(emitted), bonus_token=step.verdict.bonus_token, draft_s=step.draft_s,
        target_forward_s=timing.target_forward_s, verify_s=timing.verify_s, queue_s=timing.queue_s,
        batch_size=timing.batch_size, batch_round=timing.batch_round, network_s=timing.network_s,
        emulated_network_s=timing.emulated_network_s, step_s=step_s,
        overhead_s=max(0.0, step_s - step.draft_s - timing.queue_s - timing.verify_s - timing.network_s),
        bytes_up=timing.bytes_up, bytes_down=timing.bytes_down, tree_depth=max(tree.depths(), default=0),
        tree_widths=tree.widths(), expected_accepted=tree.expected_accepted,
        lookahead_drafted=step.lookahead_drafted, lookahead_discarded=step.lookahead_discarded,
        lookahead_reused=step.lookahead_reused, cross_tokenizer=tree.cross_tokenizer,
        draft_tokens=tree.draft_tokens, draft_source=tree.source)
