"""The planner prices suffix decoding's hybrid from its own recorded steps: which drafter took each step, what the
draft had to catch up on, and how wide each verify was."""
import dataclasses

import pytest

from specbench.api import run
from specbench.plan.explore import operating_points
from specbench.plan.predict import AcceptanceReference, LatencyProfile, OperatingPoint, predict_step
from specbench.types import SpecbenchError

from conftest import PROMPTS

TARGET = LatencyProfile("t", "cpu", rows=((1, 256, 0.10), (9, 256, 0.18)))
DRAFT = LatencyProfile("d", "cpu", rows=((1, 256, 0.010), (9, 256, 0.026)))
REPEATING = PROMPTS + [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [11]]


def hybrid_reference(**changes) -> AcceptanceReference:
    # prompt 0: the draft's chain of 3, all kept; suffix decoding's 5 nodes, 4 kept; the draft's 2, none kept.
    # prompt 1 (family b): suffix decoding's 2 nodes, both kept, before the draft's first step there
    steps = ((1, 3, 3, 3), (0, 5, 4, 5), (0, 2, 2, 2), (1, 2, 0, 2), (1, 1, 1, 1))
    fields = dict(draft="d", target="t", dataset="set", max_chain=4, hybrid_method="suffix-tree-chain",
                  hybrid_steps={16: steps}, hybrid_prompts={16: (0, 0, 1, 0, 1)},
                  hybrid_settings={"hand_over": 0.5, "other_k": 3}, prompt_families=("a", "b"))
    return AcceptanceReference(**{**fields, **changes})


def test_each_step_is_priced_as_it_ran_and_the_draft_catches_up_on_what_suffix_decoding_emitted():
    """Suffix decoding's steps draft nothing and verify 1 + nodes; the draft's first forward of a step reads what
    it has not (the last bonus, a kept chain's last token, every token suffix decoding's steps emitted since)."""
    t = lambda n: TARGET.forward_s(n, 256)  # noqa: E731
    d = lambda n: DRAFT.forward_s(n, 256)  # noqa: E731
    point = OperatingPoint("suffix-tree-chain", k=16)
    step = predict_step(point, TARGET, DRAFT, hybrid_reference())
    assert step.tokens_per_step == pytest.approx(1 + (3 + 4 + 2 + 0 + 1) / 5)
    # prompt 0: the chain (1 token to read, 2 more forwards); then 1 + 1 + (4 + 1) unread before its next step.
    # prompt 1: (2 + 1) emitted by suffix decoding, plus the first step's 1
    draft_s = (d(1) + 2 * d(1)) + (d(7) + 1 * d(1)) + d(4)
    assert step.draft_s == pytest.approx(draft_s / 5)
    assert step.verify_s == pytest.approx((t(4) + t(6) + t(3) + t(3) + t(2)) / 5)
    assert step.network_s == 0 and step.bytes_up == 0
    remote = predict_step(dataclasses.replace(point, where="remote", rtt_ms=50.0), TARGET, DRAFT, hybrid_reference())
    assert remote.network_s == pytest.approx(0.05) and remote.bytes_up > 0
    assert remote.draft_s == pytest.approx(step.draft_s) and remote.verify_s == pytest.approx(step.verify_s)
    with pytest.raises(SpecbenchError, match="draft's profile"):
        predict_step(point, TARGET, None, hybrid_reference())
    with pytest.raises(SpecbenchError, match="no recorded steps"):
        predict_step(dataclasses.replace(point, k=8), TARGET, DRAFT, hybrid_reference())


def test_the_hybrid_is_a_point_of_the_explorer_split_by_family_and_saved(tmp_path):
    from specbench.plan.library import load_references, save_reference

    reference = hybrid_reference()
    labels = [p.label for p in operating_points(reference, chain_ks=())]
    assert "suffix-tree-chain budget=16 (local)" in labels
    family = reference.for_family("b")
    assert family.hybrid_steps == {16: ((0, 2, 2, 2), (1, 1, 1, 1))} and family.hybrid_prompts == {16: (1, 1)}
    save_reference(reference, folder=tmp_path)
    loaded = load_references(tmp_path)[0]
    assert (loaded.hybrid_method, loaded.hybrid_steps, loaded.hybrid_prompts, loaded.hybrid_settings) == (
        "suffix-tree-chain", reference.hybrid_steps, reference.hybrid_prompts, reference.hybrid_settings)
    head = hybrid_reference(draft="eagle:h", hybrid_method="suffix-eagle-tree", hybrid_width=4, feature_bytes=100)
    points = operating_points(head, chain_ks=(), remote=True, rtts_ms=(20,))
    assert {p.method for p in points} >= {"suffix-eagle-tree", "suffix-eagle-tree-server"}
    served = next(p for p in points if p.method == "suffix-eagle-tree-server")
    on_client = next(p for p in points if p.method == "suffix-eagle-tree" and p.where == "remote")
    near, far = (predict_step(p, TARGET, DRAFT, head) for p in (served, on_client))
    assert near.network_s < far.network_s and near.bytes_down < far.bytes_down  # tokens only, no round trip a step


def test_a_recorded_hybrid_keeps_the_steps_of_its_run_and_prices_its_tokens_exactly(tiny_target, tiny_draft):
    """Greedy: the reference's hybrid steps are the run's (who drafted, nodes, accepted), and its predicted tokens a
    step are the run's own."""
    from specbench.record import record_reference

    knobs = dict(hand_over=0.5, other_k=3, trust=2.0)
    reference = record_reference(tiny_target, tiny_draft, REPEATING, dataset="rep", max_chain=4, max_new_tokens=24,
                                 hybrid_budgets=(8,), hybrid_suffix=knobs)
    records = run(tiny_target, REPEATING, method="suffix-tree-chain", draft=tiny_draft, k=8, max_new_tokens=24,
                  progress=False, warmup=False, suffix=dict(knobs, cache="drafter"))
    steps, prompts = reference.hybrid_steps_at(8)
    assert [s[0] for s in steps] == [int(s == "other") for s in records["draft_source"]]
    assert {0, 1} <= {s[0] for s in steps}  # both drafters took steps
    assert [s[1:3] for s in steps] == list(zip(records["drafted"], records["accepted"]))
    assert list(prompts) == list(records["prompt_index"])
    assert reference.hybrid_settings["hand_over"] == 0.5 and reference.hybrid_method == "suffix-tree-chain"
    predicted = predict_step(OperatingPoint("suffix-tree-chain", k=8), TARGET, DRAFT, reference)
    assert predicted.tokens_per_step == pytest.approx(1 + records["accepted"].mean())
    plain = run(tiny_target, REPEATING[:1], method="chain", draft=tiny_draft, k=3, max_new_tokens=8, progress=False,
                warmup=False)
    assert set(plain["draft_source"]) == {""}
    with pytest.raises(SpecbenchError, match="draft model or head"):
        record_reference(tiny_target, "prompt-lookup", REPEATING[:1], dataset="x", max_chain=2, max_new_tokens=4,
                         hybrid_budgets=(8,))
    with pytest.raises(SpecbenchError, match="drafts with a head"):
        record_reference(tiny_target, tiny_draft, REPEATING[:1], dataset="x", max_chain=2, max_new_tokens=4,
                         hybrid_budgets=(8,), hybrid_method="suffix-eagle")


def test_suffix_settings_may_be_a_dict_and_an_unknown_knob_is_named():
    from specbench.decode.suffix_drafter import SuffixSettings, as_settings

    assert as_settings({"hand_over": 0.5}) == SuffixSettings(hand_over=0.5) and as_settings(None) == SuffixSettings()
    with pytest.raises(SpecbenchError, match=r"no field\(s\) \['bogus'\]"):
        as_settings({"bogus": 1})
    with pytest.raises(SpecbenchError, match="SuffixSettings or a dict"):
        as_settings(3)


def test_a_server_prices_a_hybrid_from_its_steps_or_says_none_were_recorded(monkeypatch):
    """Served, a hybrid was once priced as its draft's tree at the same budget; now from a reference that recorded
    it, else named as not covered."""
    from specbench.plan import library
    from specbench.serve.prediction import predicted_settings

    with_steps = hybrid_reference()
    without = dataclasses.replace(with_steps, hybrid_method="", hybrid_steps={}, hybrid_prompts={},
                                  tree_accepts={16: (3, 3)}, tree_depth={16: 3.0})
    monkeypatch.setattr(library, "load_library", lambda: ([TARGET, DRAFT], [without, with_steps]))
    row = predicted_settings("t", "d", ["suffix-tree-chain"], [16])["suffix-tree-chain k=16"]
    step = predict_step(OperatingPoint("suffix-tree-chain", k=16), TARGET, DRAFT, with_steps)
    assert row["tokens_per_s"] == pytest.approx(step.tokens_per_step / step.step_s, abs=0.01)
    monkeypatch.setattr(library, "load_library", lambda: ([TARGET, DRAFT], [without]))
    assert "holds no steps of suffix-tree-chain" in predicted_settings("t", "d", ["suffix-tree-chain"], [16])[
        "suffix-tree-chain k=16"]["missing"]
