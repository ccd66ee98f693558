"""The per-prompt router: it learns which candidate is fastest where, method "auto" stays lossless and
says what it chose and why, and bad inputs are refused by name."""
import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from specbench.api import outputs, run
from specbench.route.auto import candidates_from, train_router
from specbench.route.features import repeat_share, seen_share, seen_shares
from specbench.route.router import MARGIN, Candidate, Router, fit_router
from specbench.types import SamplingParams, SpecbenchError

from conftest import PROMPTS

REPETITIVE = [[5, 6, 7, 8] * 6 + [5, 6], [9, 3, 9, 3, 9, 3, 9, 3, 9], [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1]]
PLAIN = [[11, 40, 73, 2, 95, 17], [60, 21, 88, 4, 33, 70, 12], [31, 77, 5, 64, 90, 43, 28, 9]]


def _records(prompts, lookup_tokens):
    """Synthetic records: target-only emits 1 token per 10 ms step; lookup verifies 5 tokens (14 ms a step)
    and emits `lookup_tokens(prompt)` per step."""
    rows = []
    for index, ids in enumerate(prompts):
        for step in range(6):
            rows.append(dict(method="target-only", k=0, prompt_index=index, emitted=1, drafted=0, step_s=0.010))
            rows.append(dict(method="prompt-lookup", k=4, prompt_index=index, emitted=lookup_tokens(ids),
                             drafted=4, step_s=0.014 + 0.0002 * (step % 2)))
    return pd.DataFrame(rows)


def test_router_learns_where_lookup_pays():
    prompts = REPETITIVE + PLAIN
    candidates = [Candidate("target-only"), Candidate("prompt-lookup", 4)]
    records = _records(prompts, lambda ids: 4 if repeat_share(ids, 2) > 0.3 else 1)
    router = fit_router(records, prompts, candidates, ridge=0.01)
    assert router.choose([4, 4, 7, 4, 4, 7, 4, 4, 7, 4, 4])[0].method == "prompt-lookup"
    chosen, table = router.choose([50, 81, 3, 66, 12, 97, 25])
    assert chosen.method == "target-only"
    assert set(table["candidate"]) == {"target-only", "prompt-lookup k=4"}  # the reason: every candidate's figures
    # verified tokens per output token as the objective: lookup costs 5 per 1 on a plain prompt
    frugal = fit_router(records, prompts, candidates, objective="verify_tokens", ridge=0.01)
    assert frugal.choose([50, 81, 3, 66, 12, 97, 25])[0].method == "target-only"


def test_a_prompt_leaves_the_default_only_for_a_candidate_predicted_better_by_the_margin(tmp_path):
    """The default is the candidate best over all calibration prompts (lookup here: 1.5 tokens a 14 ms step on
    repetitive prompts, 1.36 on plain ones, against target-only's 1 per 10 ms); on a plain prompt target-only is
    predicted about 3% faster: within the 5% margin the router keeps the default, without one it switches."""
    prompts = REPETITIVE + PLAIN
    candidates = [Candidate("target-only"), Candidate("prompt-lookup", 4)]
    records = _records(prompts, lambda ids: 1.5 if repeat_share(ids, 2) > 0.3 else 1.36)
    plain = [50, 81, 3, 66, 12, 97, 25]
    kept = fit_router(records, prompts, candidates, ridge=0.01)
    assert kept.default == "prompt-lookup k=4" and kept.margin == 0.05
    chosen, table = kept.choose(plain)
    speeds = table.set_index("candidate")["tokens_per_s"]
    assert 1.0 < speeds["target-only"] / speeds["prompt-lookup k=4"] < 1.05  # a close second, not chosen
    assert chosen.method == "prompt-lookup"
    assert fit_router(records, prompts, candidates, ridge=0.01, margin=0.0).choose(plain)[0].method == "target-only"
    again = Router.load(kept.save(tmp_path / "router.json"))
    assert (again.default, again.margin) == ("prompt-lookup k=4", 0.05) and again.choose(plain)[0] == chosen
    with pytest.raises(SpecbenchError, match="margin"):
        fit_router(records, prompts, candidates, margin=-0.1)


def _mixed_prompts(count: int, seed: int) -> list[list[int]]:
    """Half repetitive (a short phrase repeated), half plain (distinct ids), of varied lengths, interleaved."""
    rng = np.random.default_rng(seed)
    prompts = []
    for index in range(count):
        if index % 2 == 0:
            phrase = rng.integers(3, 90, size=int(rng.integers(2, 5))).tolist()
            prompts.append((phrase * 12)[:int(rng.integers(12, 30))])
        else:
            prompts.append(rng.permutation(np.arange(3, 90))[:int(rng.integers(6, 30))].tolist())
    return prompts


def test_a_learned_margin_routes_where_features_tell_and_keeps_the_default_where_they_do_not(tmp_path):
    """Cross-validation picks the margin: where repetition decides whether lookup pays (4 tokens a step against
    1), routing beats the default (lookup) on prompts the folds never saw, so a narrow margin wins; where
    lookup's gain is decided by something the features cannot see, every routed prompt is a guess, and the
    widest margin (always the default) wins."""
    prompts = _mixed_prompts(30, seed=0)
    candidates = [Candidate("target-only"), Candidate("prompt-lookup", 4)]
    told = _records(prompts, lambda ids: 4 if repeat_share(ids, 2) > 0.3 else 1)
    router = fit_router(told, prompts, candidates, ridge=0.1, margin="learn")
    assert router.default == "prompt-lookup k=4" and router.margin <= 0.3  # the widest that still routes
    assert router.margins[router.margin] > 1.1 * router.margins[np.inf]  # routing measured faster, held out
    assert router.choose([50, 81, 3, 66, 12, 97, 25, 44])[0].method == "target-only"
    by_default = fit_router(told, prompts, candidates, ridge=0.1)  # 30 prompts: enough to learn it
    assert by_default.margins == router.margins and by_default.margin == router.margin
    few = fit_router(told[told.prompt_index < 9], prompts[:9], candidates, ridge=0.1)
    assert few.margin == MARGIN and not few.margins  # too few to cross-validate: the fixed margin
    hidden = np.random.default_rng(1).permutation([4] * 20 + [1] * 10)  # lookup's gain, unrelated to features
    blind = _records(prompts, lambda ids: int(hidden[prompts.index(ids)]))
    kept = fit_router(blind, prompts, candidates, ridge=0.01, margin="learn")
    assert kept.margin == np.inf and kept.margins[0.0] < kept.margins[np.inf]  # routing was tried, and lost
    assert all(kept.choose(ids)[0].method == "prompt-lookup" for ids in prompts)
    again = Router.load(kept.save(tmp_path / "router.json"))
    assert again.margin == np.inf and again.margins == pytest.approx(kept.margins)
    with pytest.raises(SpecbenchError, match="at least 10 calibration prompts"):
        fit_router(told[told.prompt_index < 8], prompts[:8], candidates, margin="learn")
    with pytest.raises(SpecbenchError, match="margin must be"):
        fit_router(told, prompts, candidates, margin="wide")


def test_router_uses_a_family_when_features_do_not_tell():
    prompts = PLAIN + [list(reversed(p)) for p in PLAIN]
    families = ["code"] * 3 + ["chat"] * 3
    records = _records(prompts, lambda ids: 4 if prompts.index(ids) < 3 else 1)
    router = fit_router(records, prompts, [Candidate("target-only"), Candidate("prompt-lookup", 4)], families,
                        ridge=0.01)
    assert router.choose([8, 13, 21], "code")[0].method == "prompt-lookup"
    assert router.choose([8, 13, 21], "chat")[0].method == "target-only"


def test_dataset_rows_route_by_their_own_family():
    """`run(target, rows, method="auto")` with rows of `load_prompts`: each row's "set" reaches the router as its
    family (the router here tells code from chat by family alone), and the rows' prompts are their texts."""
    from specbench.models.tiny import tiny_model
    from tests.tokenizers_for_tests import byte_level_bpe

    prompts = PLAIN + [list(reversed(p)) for p in PLAIN]
    records = _records(prompts, lambda ids: 4 if prompts.index(ids) < 3 else 1)
    router = fit_router(records, prompts, [Candidate("target-only"), Candidate("prompt-lookup", 4)],
                        ["code"] * 3 + ["chat"] * 3, ridge=0.01)
    tokenizer = byte_level_bpe()
    target = tiny_model(seed=0, vocab_size=len(tokenizer))
    rows = [{"id": "a", "set": "chat", "prompt": "say hi say hi"}, {"id": "b", "set": "code", "prompt": "def f(x):"},
            {"id": "c", "set": "chat", "prompt": "def f(x):"}]
    got = run(target, rows, method="auto", router=router, tokenizer=tokenizer, max_new_tokens=4, progress=False)
    chosen = got.groupby("prompt_index")["chosen"].first().tolist()
    assert chosen == ["target-only", "prompt-lookup k=4", "target-only"]


def test_router_round_trips_and_refuses_a_corrupt_file(tmp_path):
    prompts = REPETITIVE + PLAIN
    router = fit_router(_records(prompts, lambda ids: 2), prompts, [Candidate("target-only"),
                                                                      Candidate("prompt-lookup", 4)])
    path = router.save(tmp_path / "router.json")
    again = Router.load(path)
    pd.testing.assert_frame_equal(router.predict(PROMPTS[0]), again.predict(PROMPTS[0]))
    (tmp_path / "bad.json").write_text(json.dumps({"candidates": "nope"}))
    with pytest.raises(SpecbenchError, match="not a router file"):
        Router.load(tmp_path / "bad.json")


def test_a_router_says_when_its_replies_are_far_longer_or_shorter_than_its_calibrations(tiny_target, tmp_path):
    """Acceptance changes along a reply (SmolLM2's long MT-bench replies repeat themselves): a router calibrated on
    12-token replies warns where it routes 30-token ones, and keeps the length it was calibrated at in its file."""
    prompts = REPETITIVE + PLAIN
    router = fit_router(_records(prompts, lambda ids: 2), prompts, [Candidate("target-only"),
                                                                      Candidate("prompt-lookup", 4)])
    assert router.length_note(500) is None  # a router that does not know its length says nothing
    router.reply_tokens = 12
    again = Router.load(router.save(tmp_path / "router.json"))
    assert again.reply_tokens == 12
    assert again.length_note(6) is None and again.length_note(24) is None
    assert "up to 12 tokens" in again.length_note(25) and "--max-new-tokens 5`" in again.length_note(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(tiny_target, PROMPTS[:1], method="auto", router=again, max_new_tokens=12, progress=False)
    assert not [w for w in caught if "calibrated on replies" in str(w.message)]
    with pytest.warns(UserWarning, match="calibrated on replies of up to 12 tokens and now serves 30-token ones"):
        run(tiny_target, PROMPTS[:1], method="auto", router=again, max_new_tokens=30, progress=False)


def test_a_router_calibrated_on_another_machine_says_so_where_it_routes(tiny_target, tmp_path):
    """A router's step costs are the calibration machine's: carried to another (a laptop's router on a GPU box), its
    choices were not checked there. It keeps the machine in its file, and a run that routes elsewhere warns."""
    from specbench.hardware import machine_label

    prompts = REPETITIVE + PLAIN
    router = fit_router(_records(prompts, lambda ids: 2), prompts, [Candidate("target-only"),
                                                                      Candidate("prompt-lookup", 4)])
    router.machine = "cpu-2t-Other-CPU"
    again = Router.load(router.save(tmp_path / "router.json"))
    assert again.machine == "cpu-2t-Other-CPU" and again.machine_note("cpu-2t-Other-CPU") is None
    with pytest.warns(UserWarning, match=rf"calibrated on cpu-2t-Other-CPU, and this machine is {machine_label()}"):
        run(tiny_target, PROMPTS[:1], method="auto", router=again, max_new_tokens=12, progress=False)
    again.machine = machine_label()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(tiny_target, PROMPTS[:1], method="auto", router=again, max_new_tokens=12, progress=False)
    assert not [w for w in caught if "this machine is" in str(w.message)]
    before = json.loads((tmp_path / "router.json").read_text())
    before.pop("machine")  # a file saved before machines were kept says nothing
    (tmp_path / "old.json").write_text(json.dumps(before))
    assert Router.load(tmp_path / "old.json").machine_note("anything") is None


def test_bad_router_inputs_are_refused_by_name(tiny_target):
    with pytest.raises(SpecbenchError, match="unknown method"):
        candidates_from(["suffix:16", "telepathy"])
    with pytest.raises(SpecbenchError, match="whole number"):
        candidates_from(["suffix:many"])
    with pytest.raises(SpecbenchError, match="calibration prompts"):
        train_router(tiny_target, [], candidates_from(["target-only"]))
    with pytest.raises(SpecbenchError, match="pass draft"):
        train_router(tiny_target, PROMPTS, candidates_from(["chain:4"]))
    with pytest.raises(SpecbenchError, match="lack prompts"):
        fit_router(_records(PLAIN[:2], lambda ids: 1), PLAIN, [Candidate("target-only")])
    with pytest.raises(SpecbenchError, match="router="):
        run(tiny_target, PROMPTS[:1], method="auto", progress=False)


def test_auto_is_lossless_and_says_what_it_chose(tiny_target, tiny_draft):
    candidates = candidates_from(["target-only", "prompt-lookup:4", "suffix:8", "chain:3"])
    router, records = train_router(tiny_target, PROMPTS, candidates, draft=tiny_draft, max_new_tokens=24,
                                   progress=False)
    assert set(records["method"]) == {"target-only", "prompt-lookup", "suffix", "chain"}
    assert router.reply_tokens == 24  # the length its choices were checked for
    from specbench.hardware import machine_label

    assert router.machine == machine_label()  # and the machine
    got = run(tiny_target, PROMPTS, method=["target-only", "auto"], router=router, draft=tiny_draft,
              max_new_tokens=24, progress=False)
    produced = outputs(got)
    for index in range(len(PROMPTS)):
        assert produced[("auto", index)] == produced[("target-only", index)]
    auto = got[got["method"] == "auto"]
    assert set(auto["chosen"]) <= {c.label for c in candidates}
    reasons = json.loads(auto["route_predicted"].iloc[0])
    assert set(reasons) == {c.label for c in candidates} and all(np.isfinite(list(reasons.values())))
    assert (auto["route_s"] < 0.05).all()


def test_calibration_interleaves_candidates_and_keeps_their_suffix_caches_apart(tiny_target):
    """Candidates take turns chunk by chunk (order reversed every other chunk), so drift weighs on all alike;
    each suffix candidate drafts exactly as it would alone with its own cache, never from another candidate's
    answers to the same prompts (which would inflate its acceptance)."""
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.route.auto import calibrate

    prompts = PROMPTS * 2  # repeats: a cache shared across candidates would recall the first one's answers
    candidates = candidates_from(["target-only", "suffix:8", "suffix-tree:8"])
    records = calibrate(tiny_target, prompts, candidates, max_new_tokens=16, chunk=3, progress=False)
    blocks = records.groupby(["method", "prompt_index"], sort=False).size().index.tolist()
    firsts = [method for method, index in blocks if index in (0, 3, 6)]  # each chunk's first prompt, in run order
    assert firsts == ["target-only", "suffix", "suffix-tree", "suffix-tree", "suffix", "target-only",
                      "target-only", "suffix", "suffix-tree"]
    assert sorted(set(records["prompt_index"])) == list(range(len(prompts)))
    for method in ("suffix", "suffix-tree"):
        alone = run(tiny_target, prompts, method=method, k=8, max_new_tokens=16, progress=False,
                    suffix=SuffixSettings(cache="drafter"))
        mine = records[records["method"] == method]
        assert mine.groupby("prompt_index")["drafted"].apply(list).tolist() == \
            alone.groupby("prompt_index")["drafted"].apply(list).tolist()
        assert outputs(mine) == outputs(alone)


def test_auto_routes_to_worker_methods(tiny_target):
    """Candidates that run wholly on a worker (the worker's own suffix cache, its draft model) are routed to
    from the client: only the choice is made here."""
    from specbench.worker.client import RemoteTarget
    from worker_helpers import ThreadWorker

    running = ThreadWorker()
    try:
        remote = RemoteTarget(running.endpoint)
        candidates = candidates_from(["server-only-ar", "suffix-server:8", "server-only:3"])
        router, _ = train_router(remote, PROMPTS[:3], candidates, max_new_tokens=16, progress=False)
        got = outputs(run(remote, PROMPTS[:3], method="auto", router=router, max_new_tokens=16, progress=False))
    finally:
        running.stop()
    local = outputs(run(tiny_target, PROMPTS[:3], method="target-only", max_new_tokens=16, progress=False))
    assert [got[("auto", i)] for i in range(3)] == [local[("target-only", i)] for i in range(3)]


def test_a_worker_routes_with_its_own_router(tiny_target, tiny_draft, tmp_path):
    """auto-server: the worker picks each prompt's worker method with the router it was started with."""
    from specbench.worker.client import RemoteTarget, WorkerError
    from worker_helpers import ThreadWorker

    # run on the worker as their -server forms; suffix decoding's K over --max-generate-k (8): its lookups are no
    # draft forwards, so only the verify's nodes bound it (this router was once refused at every suffix choice)
    candidates = candidates_from(["target-only", "suffix:16", "chain:3"])
    router, _ = train_router(tiny_target, PROMPTS, candidates, draft=tiny_draft, max_new_tokens=16, progress=False)
    path = router.save(tmp_path / "router.json")
    router.machine = "cpu-2t-Laptop-CPU -> worker NVIDIA-H100-80GB-HBM3"  # calibrated through a GPU worker
    elsewhere = router.save(tmp_path / "elsewhere.json")
    plain = ThreadWorker()
    routed = ThreadWorker(router=str(path))
    foreign = ThreadWorker(router=str(elsewhere))
    try:
        with pytest.raises(WorkerError, match="--router"):
            run(RemoteTarget(plain.endpoint), PROMPTS[:1], method="auto-server", max_new_tokens=8, progress=False)
        got = run(RemoteTarget(routed.endpoint), PROMPTS, method="auto-server", max_new_tokens=16, progress=False)
        longer = run(RemoteTarget(routed.endpoint), PROMPTS[:1], method="auto-server", max_new_tokens=40,
                     progress=False)
        suffix = run(RemoteTarget(routed.endpoint), PROMPTS, method="suffix-tree-server", k=16, max_new_tokens=16,
                     progress=False)
        moved = run(RemoteTarget(foreign.endpoint), PROMPTS[:1], method="auto-server", max_new_tokens=40,
                    progress=False)
    finally:
        plain.stop()
        routed.stop()
        foreign.stop()
    local = outputs(run(tiny_target, PROMPTS, method="target-only", max_new_tokens=16, progress=False))
    assert [outputs(got)[("auto-server", i)] for i in range(4)] == [local[("target-only", i)] for i in range(4)]
    assert [outputs(suffix)[("suffix-tree-server", i)] for i in range(4)] == [local[("target-only", i)]
                                                                             for i in range(4)]
    assert set(got["chosen"]) <= {"server-only-ar k=4", "suffix-server k=16", "server-only k=3"}
    assert set(json.loads(got["route_predicted"].iloc[0])) == {c.label for c in candidates}
    assert "route_note" not in got and "up to 16 tokens and now serves 40-token" in longer["route_note"].iloc[0]
    # the worker drafts and verifies every auto-server choice, so a router whose target ran elsewhere says so
    note = moved["route_note"].iloc[0]
    assert "up to 16 tokens" in note and "this router's target ran on NVIDIA-H100-80GB-HBM3" in note


def test_a_workers_router_compares_the_device_its_target_ran_on():
    from specbench.hardware import device_name, machine_label
    from specbench.worker.long_requests import router_machine_note

    here = device_name("cpu")
    assert router_machine_note(machine_label("cpu"), "cpu") is None  # calibrated here, on the CPU
    assert router_machine_note(f"cpu-2t-Laptop-CPU -> worker {here}", "cpu") is None  # through this worker
    assert router_machine_note(None, "cpu") is None  # a file from before machines were kept
    note = router_machine_note(f"{here} + NVIDIA-H200", "cpu")  # calibrated here with the target on a GPU
    assert note.startswith("this router's target ran on NVIDIA-H200, and this machine is " + here)


def test_references_keep_per_prompt_rows_and_narrow_to_a_family(tiny_target, tiny_draft, tmp_path):
    from specbench.plan.library import load_references, save_reference
    from specbench.record import record_reference

    families = ["code", "chat", "code", "chat"]
    reference = record_reference(tiny_target, tiny_draft, PROMPTS, dataset="mixed", max_chain=4, tree_budgets=(4,),
                                 max_new_tokens=16, families=families)
    assert len(reference.chain_prompts) == len(reference.chain_accepts)
    code = reference.for_family("code")
    assert code.dataset == "mixed/code" and set(code.chain_prompts) <= {0, 2}
    assert len(code.chain_accepts) + len(reference.for_family("chat").chain_accepts) == len(reference.chain_accepts)
    chat = reference.for_family("chat")
    assert sum(code.tree_accepts[4]) + sum(chat.tree_accepts[4]) == sum(reference.tree_accepts[4])
    with pytest.raises(SpecbenchError, match="no family 'math'"):
        reference.for_family("math")
    save_reference(reference, folder=tmp_path)
    loaded = load_references(tmp_path, by_family=True)
    assert sorted(r.dataset for r in loaded) == ["mixed", "mixed/chat", "mixed/code"]
    assert next(r for r in loaded if r.dataset == "mixed/code").chain_accepts == code.chain_accepts


def test_a_lookup_references_family_is_priced_from_that_familys_steps_only(tiny_target, tmp_path):
    """Prompt lookup keeps every step of its run (`steps_at_k`), which the predictor prices first: a family's
    reference keeps its own prompts' steps, round-trips them, and so predicts from them (not the whole set's);
    steps recorded without their prompts are dropped from a family rather than priced for every family alike."""
    from dataclasses import replace

    from specbench.plan.library import load_references, save_reference
    from specbench.record import record_reference

    repeating = [list(PROMPTS[0]) * 3, list(PROMPTS[1]), list(PROMPTS[2]) * 3, list(PROMPTS[3])]
    families = ["repeats", "once", "repeats", "once"]
    reference = record_reference(tiny_target, "prompt-lookup", repeating, dataset="mixed", max_chain=4,
                                 tree_budgets=(6,), max_new_tokens=16, families=families)
    whole = reference.steps_at_k[4]
    grown = reference.tree_steps[6]  # every step of the tree run, the ones that drafted nothing too
    assert len(grown) == len(reference.tree_steps_prompts[6]) and any(d == 0 for d, _ in grown)
    assert len(grown) > len(reference.tree_accepts.get(6, ())) and all(0 <= a <= d <= 6 for d, a in grown)
    assert sum(len(reference.for_family(f).tree_steps.get(6, ())) for f in ("repeats", "once")) == len(grown)
    assert len(reference.steps_prompts[4]) == len(whole)
    parts = {family: reference.for_family(family) for family in ("repeats", "once")}
    assert sum(len(part.steps_at_k.get(4, ())) for part in parts.values()) == len(whole)
    assert set(parts["repeats"].steps_prompts[4]) <= {0, 2}
    counted = {family: sorted(part.steps_at_k[4]) for family, part in parts.items() if part.steps_at_k}
    assert sorted(step for steps in counted.values() for step in steps) == sorted(whole)
    save_reference(reference, folder=tmp_path)
    loaded = {r.dataset: r for r in load_references(tmp_path, by_family=True)}
    assert loaded["mixed/repeats"].steps_at_k == parts["repeats"].steps_at_k
    unknown = replace(reference, steps_prompts={})
    assert unknown.for_family("repeats").steps_at_k == {}


def test_step_costs_are_fitted_jointly_with_a_model_drafts_own_cost():
    """One target forward for every candidate (fixed + per verified token), plus a model draft's cost per drafted
    token: recovered from noisy steps, also for a lookup whose widths alone would not tell them apart."""
    from specbench.route.router import _step_costs, rows_of

    rng = np.random.default_rng(0)
    rows = []
    for method, k, draft_s in (("target-only", 0, 0.0), ("prompt-lookup", 4, 0.0), ("chain", 4, 0.02)):
        for _ in range(200):
            drafted = 0 if method == "target-only" else int(rng.integers(0, k + 1))
            rows.append(dict(method=method, k=k, prompt_index=0, drafted=drafted, emitted=1,
                             step_s=0.05 + 0.004 * (1 + drafted) + draft_s * drafted + rng.normal(0, 0.003)))
    records = pd.DataFrame(rows)
    costs = _step_costs({c: rows_of(records, c) for c in (Candidate("target-only"), Candidate("prompt-lookup", 4),
                                                           Candidate("chain", 4))})
    assert costs["prompt-lookup k=4"] == pytest.approx((0.05, 0.004), abs=0.002)
    fixed, per_token = costs["chain k=4"]
    assert fixed + per_token * 5 == pytest.approx(0.05 + 0.004 * 5 + 0.02 * 4, abs=0.003)


def test_a_worker_refuses_a_router_whose_candidates_cannot_run_there(tmp_path):
    from specbench.worker.long_requests import worker_router

    prompts = REPETITIVE + PLAIN
    router = fit_router(_records(prompts, lambda ids: 2), prompts, [Candidate("target-only"),
                                                                      Candidate("prompt-lookup", 4)])
    with pytest.raises(SpecbenchError, match=r"\['prompt-lookup k=4'\] have no worker method"):
        worker_router(str(router.save(tmp_path / "router.json")))


def test_a_generates_k_is_held_to_the_limit_that_bounds_its_step(tmp_path):
    """--max-generate-k bounds the draft forwards of a step (a draft model's or head's k, a hybrid's other_k of
    it), --max-tree-nodes its verify's nodes (suffix decoding's lookups included); a worker started with a router
    whose candidate it would refuse says so before it serves, naming the candidate and the flag."""
    from specbench.worker.limits import WorkerLimits
    from specbench.worker.long_requests import check_step, worker_router
    from specbench.worker.protocol import LimitError

    limits = WorkerLimits()  # 8 forwards, 256 nodes
    check_step("suffix-tree-server", 16, {}, limits)
    check_step("suffix-eagle-server", 16, {"other_k": 8}, limits)
    check_step("server-only-ar", 1, {}, limits)
    for method, k, suffix, flag in (("server-only", 9, {}, "--max-generate-k"),
                                    ("eagle-tree-server", 9, {}, "--max-generate-k"),
                                    ("suffix-eagle-tree-server", 16, {"other_k": 9}, "--max-generate-k"),
                                    ("suffix-server", 257, {}, "--max-tree-nodes")):
        with pytest.raises(LimitError, match=f"{method} k={k}.*{flag}"):
            check_step(method, k, suffix, limits)
    prompts = REPETITIVE + PLAIN
    records = _records(prompts, lambda ids: 2)
    records = pd.concat([records, records.assign(method="suffix", k=16),
                         records[records["method"] == "prompt-lookup"].assign(method="chain", k=12)])
    router = fit_router(records, prompts, [Candidate("target-only"), Candidate("suffix", 16), Candidate("chain", 12)])
    path = str(router.save(tmp_path / "router.json"))
    worker_router(path)  # no limits given: only where candidates run is checked
    with pytest.raises(SpecbenchError, match=r"candidate chain k=12 is over .*--max-generate-k"):
        worker_router(path, limits)
    assert worker_router(path, WorkerLimits(max_generate_k=12)).candidates == router.candidates


def test_drafting_is_priced_per_step_where_records_time_it():
    """A hybrid drafting 12 cheap tokens a step on repetitive prompts and 3 costly ones on plain prompts: priced
    per drafted token (the whole step's time regressed on drafted tokens) it looks dear exactly where it drafts
    most; with `draft_s` in the records each prompt's drafting seconds are fitted from its features, and the
    target's forward from everything else."""
    prompts = REPETITIVE + PLAIN
    rows = []
    for index, ids in enumerate(prompts):
        repetitive = index < len(REPETITIVE)
        for step in range(6):
            rows.append(dict(method="target-only", k=0, prompt_index=index, emitted=1, drafted=0, draft_s=0.0,
                             step_s=0.010))
            drafted, draft_s = (12, 0.0005) if repetitive else (3, 0.006)
            rows.append(dict(method="suffix-eagle-tree", k=16, prompt_index=index, emitted=5 if repetitive else 2,
                             drafted=drafted, draft_s=draft_s, step_s=0.010 + 0.0005 * (1 + drafted) + draft_s))
    records = pd.DataFrame(rows)
    candidates = [Candidate("target-only"), Candidate("suffix-eagle-tree", 16)]
    router = fit_router(records, prompts, candidates, ridge=0.01)
    for ids, (drafted, draft_s) in ((REPETITIVE[0], (12, 0.0005)), (PLAIN[0], (3, 0.006))):
        table = router.predict(ids).set_index("candidate")
        assert table.loc["suffix-eagle-tree k=16", "step_s"] == pytest.approx(
            0.010 + 0.0005 * (1 + drafted) + draft_s, rel=0.05)
    again = Router.load(router.save(Path(tempfile.mkdtemp()) / "router.json"))
    assert again.predict(PLAIN[0])["step_s"].tolist() == pytest.approx(router.predict(PLAIN[0])["step_s"].tolist())
    untimed = fit_router(records.drop(columns="draft_s"), prompts, candidates, ridge=0.01)
    assert untimed.fits["suffix-eagle-tree k=16"].draft_s is None


def test_workload_oracle_cross_fitted_takes_each_choice_from_the_other_pass():
    """benchmarks/workload.py: the plain oracle keeps each pass's fastest timing, so pure timing noise lifts it
    above candidates that are identical; the cross-fitted one times each prompt's choice on the other pass."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from workload import oracles

    seconds = {("p0", 0): {"a": 1.0, "b": 2.0}, ("p0", 1): {"a": 3.0, "b": 2.5},
               ("p1", 0): {"a": 2.0, "b": 1.5}, ("p1", 1): {"a": 1.2, "b": 4.0}}
    rows = pd.DataFrame([{"prompt": p, "pass": t, "label": label, "tokens": 10, "seconds": s}
                         for (p, t), timed in seconds.items() for label, s in timed.items()])
    best, crossed = oracles(rows, ["a", "b"])
    assert sorted(zip(best.prompt, best["pass"], best.label)) == [("p0", 0, "a"), ("p0", 1, "b"), ("p1", 0, "b"),
                                                                   ("p1", 1, "a")]
    # p0: pass 0 chose a -> its pass-1 time 3.0; pass 1 chose b -> its pass-0 time 2.0; p1 likewise
    assert sorted(zip(crossed.prompt, crossed["pass"], crossed.seconds)) == [("p0", 0, 2.0), ("p0", 1, 3.0),
                                                                             ("p1", 0, 2.0), ("p1", 1, 4.0)]
    assert best.seconds.sum() < min(rows[rows.label == x].seconds.sum() for x in "ab") < crossed.seconds.sum()
    one_pass, none = oracles(rows[rows["pass"] == 0], ["a", "b"])
    assert len(one_pass) == 2 and none.empty


def test_workload_reports_the_boxs_drift_between_passes(capsys):
    """benchmarks/workload.py: target-only's steps are the same on every pass, so its pace per pass is the box's;
    a move of over 2% is printed as drift, a steadier box prints nothing."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from workload import summarise

    def rows(second_pass: float) -> pd.DataFrame:
        timed = {"target-only": 1.0, "a": 0.5, "auto": 0.45}
        return pd.DataFrame([{"family": "f", "prompt": p, "pass": t, "label": label, "tokens": 10, "steps": 5,
                              "seconds": s * (second_pass if t else 1.0), "route_s": 0.001, "chosen": "a"}
                             for p in ("p0", "p1") for t in (0, 1) for label, s in timed.items()])

    goals = summarise(rows(1.1), ["target-only", "a"])["goals"]
    assert goals["target_only_by_pass"] == pytest.approx({"0": 10.0, "1": 10 / 1.1})
    assert "a 10.0% drift of the box" in capsys.readouterr().out
    summarise(rows(1.01), ["target-only", "a"])
    assert "drift" not in capsys.readouterr().out


def test_group_ceilings_choose_one_candidate_a_group_on_the_same_or_the_other_pass():
    """benchmarks/router_refit.py --ceilings: per family, and per family and first or later turn, the candidate
    fastest over the group (pooled) on the same pass or on the other one, over that pass's best fixed method."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from router_refit import group_ceilings

    seconds = {0: {"f0": {"a": 1.0, "b": 2.0}, "f1": {"a": 2.0, "b": 0.8}, "g0": {"a": 1.0, "b": 1.5}},
               1: {"f0": {"a": 2.0, "b": 1.0}, "f1": {"a": 2.0, "b": 0.8}, "g0": {"a": 1.0, "b": 1.5}}}
    rows = pd.DataFrame([{"family": p[0], "prompt": p, "pass": t, "label": label, "tokens": 10, "seconds": s}
                         for t, by_prompt in seconds.items() for p, timed in by_prompt.items()
                         for label, s in timed.items()] + [{"family": "f", "prompt": "f0", "pass": 0, "label": "auto",
                                                            "tokens": 10, "seconds": 0.1}])
    table = group_ceilings(rows, {"f0": 0.0, "f1": 0.3, "g0": 0.0}).set_index(["groups", "pass"])
    # best fixed: a on pass 0 (4 s), b on pass 1 (3.3 s); auto's rows are not a candidate
    # family: f -> b, g -> a on either pass (2.8 + 1.0 s on pass 0; 1.8 + 1.0 on pass 1)
    assert table.loc[("family", 0)].tolist() == pytest.approx([4 / 3.8, 4 / 3.8])
    assert table.loc[("family", 1)].tolist() == pytest.approx([3.3 / 2.8, 3.3 / 2.8])
    # split by turn: f0 (fresh) a on pass 0, b on pass 1; crossed, each pass runs the other's choice
    assert table.loc[("family x quoted", 0)].tolist() == pytest.approx([4 / 2.8, 4 / 3.8])
    assert table.loc[("family x quoted", 1)].tolist() == pytest.approx([3.3 / 2.8, 3.3 / 3.8])


def test_workload_calibrates_again_the_candidates_a_chosen_knob_changes():
    """benchmarks/workload.py picks suffix knobs by replaying the calibration run, then calibrates again the
    candidates those knobs change (the router once learned a hybrid at hand-over 1.0 and ran it at 0.5)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from workload import _knobs_touch

    hybrid, tree, chain = Candidate("suffix-tree-chain", 16), Candidate("suffix-tree", 16), Candidate("chain", 3)
    assert _knobs_touch(hybrid, {"catch_up"}) and _knobs_touch(hybrid, {"hand_over"})
    assert _knobs_touch(hybrid, {"min_score"}) and _knobs_touch(tree, {"min_score"})
    assert not _knobs_touch(tree, {"hand_over", "catch_up"})  # suffix decoding alone never hands a step over
    assert not _knobs_touch(chain, {"min_score", "hand_over", "catch_up"})
    assert not _knobs_touch(Candidate("target-only"), {"min_score"}) and not _knobs_touch(hybrid, set())


def test_a_family_default_starts_each_prompt_from_what_its_family_measured(tmp_path):
    """By family: lookup pays 4 tokens a step on code, nothing on chat, and the repetition features say nothing of
    it (prompts alike in both). A strongly shrunk ridge fit cannot tell the families apart; each family's measured
    best can, and cross-validation finds it on prompts the folds never saw. A prompt of an uncalibrated family
    starts from the overall default; families that all measure alike leave the overall default in place."""
    prompts = _mixed_prompts(30, seed=2)
    families = ["code" if i % 3 else "chat" for i in range(30)]  # 20 code, 10 chat
    candidates = [Candidate("target-only"), Candidate("prompt-lookup", 4)]
    records = _records(prompts, lambda ids: 4 if families[prompts.index(ids)] == "code" else 1)
    router = fit_router(records, prompts, candidates, families, ridge=100.0)
    assert router.family_defaults == {"code": "prompt-lookup k=4", "chat": "target-only"}
    assert router.default == "prompt-lookup k=4" and router.by_family
    assert max(router.family_margins.values()) > 1.1 * max(router.margins.values())  # measured, held out
    plain = [50, 81, 3, 66, 12, 97, 25, 44]
    assert router.choose(plain, "chat")[0].method == "target-only"
    assert router.choose(plain, "code")[0].method == "prompt-lookup"
    assert router.default_for("poetry") == router.default and router.choose(plain, "poetry")[0].method == \
        "prompt-lookup"
    again = Router.load(router.save(tmp_path / "router.json"))
    assert again.by_family and again.family_defaults == router.family_defaults
    assert again.family_margins == pytest.approx(router.family_margins)
    assert again.choose(plain, "chat")[0].method == "target-only"
    off = fit_router(records, prompts, candidates, families, ridge=100.0, margin=np.inf)  # a fixed margin: off
    assert not off.by_family and off.choose(plain, "chat")[0].method == "prompt-lookup"
    on = fit_router(records, prompts, candidates, families, ridge=100.0, margin=np.inf, by_family=True)
    assert on.choose(plain, "chat")[0].method == "target-only"
    alike = _records(prompts, lambda ids: 4 if repeat_share(ids, 2) > 0.3 else 1)  # family says nothing here
    level = fit_router(alike, prompts, candidates, families, ridge=0.1)
    assert set(level.family_defaults.values()) == {"prompt-lookup k=4"} and not level.by_family
    unlabelled = fit_router(alike, prompts, candidates, ridge=0.1)
    assert not unlabelled.family_margins and not unlabelled.family_defaults  # nothing to try without families


def test_a_worker_routes_by_the_family_its_client_names(tiny_target, tmp_path):
    """auto-server with family defaults: the client sends each dataset row's family, the worker's router starts
    from that family's default (suffix decoding for code, target-only for chat here, the prompts alike), and
    a family name that is no name is refused by name while the worker keeps serving."""
    from specbench.worker.client import RemoteTarget, WorkerError
    from worker_helpers import ThreadWorker

    prompts = _mixed_prompts(12, seed=3)
    families = ["code", "chat"] * 6
    rows = [dict(method=m, k=k, prompt_index=i, emitted=e, drafted=d, step_s=s)
            for i in range(12) for _ in range(4)
            for m, k, e, d, s in (("target-only", 0, 1, 0, 0.010),
                                  ("suffix", 8, 3 if families[i] == "code" else 1, 8, 0.015))]
    router = fit_router(pd.DataFrame(rows), prompts, candidates_from(["target-only", "suffix:8"]), families,
                        margin=np.inf, by_family=True)
    assert router.family_defaults == {"code": "suffix k=8", "chat": "target-only"}
    path = router.save(tmp_path / "router.json")
    running = ThreadWorker(router=str(path))
    asked = [[5, 9, 5, 9, 5, 9, 5], [5, 9, 5, 9, 5, 9, 5], [17, 3, 44, 8]]
    try:
        remote = RemoteTarget(running.endpoint)
        got = run(remote, asked, method="auto-server", max_new_tokens=12, progress=False,
                  families=["chat", "code", "chat"])
        with pytest.raises(WorkerError, match="family"):
            remote.generate_on_worker("auto-server", [5, 6, 7], k=4, max_new_tokens=4, sampling=SamplingParams(),
                                      seed=0, family="x" * 500)
        assert remote.health()  # still serving
        local = outputs(run(remote, asked, method="server-only-ar", max_new_tokens=12, progress=False))
    finally:
        running.stop()
    chosen = got.groupby("prompt_index")["chosen"].first().tolist()
    assert chosen == ["server-only-ar k=4", "suffix-server k=8", "server-only-ar k=4"]
    assert got.groupby("prompt_index")["route_default"].first().tolist() == ["target-only", "suffix k=8",
                                                                              "target-only"]
    assert [outputs(got)[("auto-server", i)] for i in range(3)] == [local[("server-only-ar", i)] for i in range(3)]


def test_seen_share_counts_the_prompt_ngrams_earlier_outputs_hold():
    """Against a brute-force search on random strings of a small alphabet (many partial matches), through the
    index and the cache a run's suffix drafters share; `seen_shares` looks only at the outputs before each prompt."""
    import random

    from specbench.decode.suffix_drafter import SuffixCache
    from specbench.decode.suffix_index import SuffixIndex

    rng = random.Random(3)
    for _ in range(40):
        made = [[rng.randrange(5) for _ in range(rng.randrange(0, 40))] for _ in range(3)]
        prompt = [rng.randrange(5) for _ in range(rng.randrange(0, 30))]
        index, cache = SuffixIndex(depth=8), SuffixCache(depth=8)
        for number, output in enumerate(made):
            index.extend(number, output)
            cache.extend(cache.open(), output)
        for n in (2, 4, 8):
            grams = [tuple(prompt[s:s + n]) for s in range(len(prompt) - n + 1)]
            held = {tuple(o[s:s + n]) for o in made for s in range(len(o) - n + 1)}
            expected = sum(gram in held for gram in grams) / len(grams) if grams else 0.0
            assert seen_share(prompt, index, n) == pytest.approx(expected)
            assert seen_share(prompt, cache, n) == pytest.approx(expected)
    assert seen_share(PLAIN[0], None) == 0.0
    quoted = list(range(10, 20))
    assert seen_shares([[1, 1, 1] + quoted, quoted, quoted[:5]], [quoted, [], [3]]) == [0.0, 1.0, 0.0]


def test_router_reads_how_much_of_a_prompt_earlier_outputs_hold(tmp_path):
    """Prompts alike inside (no repetition), half of them quoting an earlier answer: only the seen share says
    lookup pays there. A router file saved before the feature (or with no feature list) still loads, without it."""
    rng = np.random.default_rng(0)
    prompts = [rng.permutation(np.arange(100, 1000))[:12].tolist() for _ in range(16)]
    seen = [0.8 if i % 2 else 0.0 for i in range(16)]
    by_prompt = {tuple(ids): share for ids, share in zip(prompts, seen)}
    records = _records(prompts, lambda ids: 4 if by_prompt[tuple(ids)] else 1)
    candidates = [Candidate("target-only"), Candidate("prompt-lookup", 4)]
    router = fit_router(records, prompts, candidates, ridge=0.01, margin=0.0, seen=seen)
    fresh = rng.permutation(np.arange(100, 1000))[:12].tolist()
    assert router.reads_seen
    assert router.choose(fresh, seen=0.8)[0].method == "prompt-lookup"
    assert router.choose(fresh, seen=0.0)[0].method == "target-only"
    blind = fit_router(records, prompts, candidates, ridge=0.01, margin=0.0)  # no seen shares: it cannot tell
    assert blind.choose(fresh, seen=0.8)[0] == blind.choose(fresh, seen=0.0)[0]
    with pytest.raises(SpecbenchError, match="seen share per prompt"):
        fit_router(records, prompts, candidates, seen=seen[:3])
    path = router.save(tmp_path / "router.json")
    assert Router.load(path).choose(fresh, seen=0.8)[0].method == "prompt-lookup"
    body = json.loads(path.read_text())  # as a file saved before seen_8 existed: its column never there
    gone = body["features"].index("seen_8")
    for vector in [body["mean"], body["scale"]] + [fit[part] for fit in body["fits"].values()
                                                   for part in ("tokens", "drafted")]:
        del vector[gone]
    body["features"].remove("seen_8")
    for kept in (True, False):  # with its feature list, and from before files kept one
        if not kept:
            del body["features"]
        (tmp_path / "old.json").write_text(json.dumps(body))
        old = Router.load(tmp_path / "old.json")
        assert not old.reads_seen
        assert old.predict(fresh, seen=0.8).equals(old.predict(fresh, seen=0.0))
    body["features"] = ["log_length", "moon_phase"]
    (tmp_path / "odd.json").write_text(json.dumps(body))
    with pytest.raises(SpecbenchError, match="moon_phase"):
        Router.load(tmp_path / "odd.json")


def test_auto_reads_the_outputs_before_each_prompt_and_a_late_suffix_drafter_gets_them(tiny_target, monkeypatch):
    """run(method="auto") gives the router each prompt's seen share from the cache of this call's earlier
    outputs; a suffix candidate first chosen for a later prompt starts with those outputs in its cache, as it had
    them in calibration (it was once built empty, missing every answer before it)."""
    from specbench.decode.suffix_drafter import SuffixSettings

    candidates = candidates_from(["target-only", "suffix:8"])
    router, _ = train_router(tiny_target, PROMPTS, candidates, max_new_tokens=16, progress=False)
    assert router.reads_seen
    first = outputs(run(tiny_target, PROMPTS[:1], method="target-only", max_new_tokens=16, progress=False))
    quoting = PROMPTS[1] + first[("target-only", 0)]  # a later turn that quotes the first prompt's answer
    asked, picks = [], iter([0, 0, 1])
    real = Router.choose

    def scripted(self, ids, family=None, seen=0.0):
        asked.append(seen)
        _, table = real(self, ids, family, seen)
        return self.candidates[next(picks)], table

    monkeypatch.setattr(Router, "choose", scripted)
    built = []
    got = run(tiny_target, [PROMPTS[0], PROMPTS[2], quoting], method=["target-only", "auto"], router=router,
              max_new_tokens=16, progress=False, suffix=SuffixSettings(cache="drafter"),
              wrap_drafter=lambda drafter: built.append(drafter) or drafter)
    assert asked[0] == 0.0 and asked[2] > 0.5  # the quoted answer is in the cache by the third prompt
    suffix = [d for d in built if getattr(d, "cache", None) is not None and getattr(d, "name", "") == "suffix"]
    assert len(suffix) == 1 and len(suffix[0].cache) == 3  # two earlier outputs handed over, then its own
    produced = outputs(got)
    assert all(produced[("auto", i)] == produced[("target-only", i)] for i in range(3))


def test_candidates_may_each_draft_with_their_own_model(tiny_target, tiny_draft, tmp_path):
    """"chain:3@close" and "chain:3@far" (SpecDecode's per-prompt draft choice): calibration runs each with its own
    draft, the router keeps them apart (rows, fits, labels, its file), and auto runs the chosen one with its own
    draft, lossless; a draft that accepts more on every prompt drafts more tokens a step in its records."""
    from specbench.models.tiny import tiny_model

    far = tiny_model(seed=1, noise_from=tiny_target, noise_scale=0.05)  # a worse copy than tiny_draft's 0.005
    drafts = {"close": tiny_draft, "far": far}
    candidates = candidates_from(["target-only", "chain:3@close", "chain:3@far"])
    assert [c.label for c in candidates] == ["target-only", "chain@close k=3", "chain@far k=3"]
    assert [c.spec for c in candidates[1:]] == ["chain:3@close", "chain:3@far"]
    router, records = train_router(tiny_target, PROMPTS, candidates, drafts=drafts, max_new_tokens=24, progress=False)
    assert set(records["method"]) == {"target-only", "chain@close", "chain@far"}
    per_step = records.groupby("method")["accepted"].mean()
    assert per_step["chain@close"] > per_step["chain@far"]  # each ran its own draft
    assert set(router.fits) == {c.label for c in candidates}
    again = Router.load(router.save(tmp_path / "router.json"))
    assert again.candidates == router.candidates and again.candidates[1].draft == "close"
    got = run(tiny_target, PROMPTS, method=["target-only", "auto", "chain:3@far"], router=again, drafts=drafts,
              max_new_tokens=24, progress=False)
    produced = outputs(got)
    for index in range(len(PROMPTS)):
        assert produced[("auto", index)] == produced[("chain@far", index)] == produced[("target-only", index)]
    assert set(got.loc[got["method"] == "auto", "chosen"]) <= {c.label for c in candidates}
    chosen_close = got[(got["method"] == "auto") & (got["chosen"] == "chain@close k=3")]
    if not chosen_close.empty:  # the chosen candidate drafted with its own model: its acceptance, not far's
        assert chosen_close["accepted"].mean() > got[got["method"] == "chain@far"]["accepted"].mean()
    with pytest.raises(SpecbenchError, match="auto is the router itself"):
        candidates_from(["target-only", "auto"])
    with pytest.raises(SpecbenchError, match="takes no '@draft'"):
        candidates_from(["prompt-lookup:4@close"])


def test_a_worker_routes_to_a_candidate_with_its_own_draft(tiny_target, tmp_path):
    """A worker's router whose candidate names its own draft ("server-only:3@MODEL"): the worker drafts that
    prompt with MODEL where it may load it (`--allow-load`), lossless, and says so in `chosen`; a worker not
    allowed to load it refuses by name."""
    from specbench.worker.client import RemoteTarget, WorkerError
    from worker_helpers import ThreadWorker

    far = "tiny-random:seed=1,noise=0.05,noise_from=0"
    allowed = ThreadWorker(allow_load=(far,))
    try:
        remote = RemoteTarget(allowed.endpoint)
        candidates = candidates_from(["server-only-ar", f"server-only:3@{far}"])
        router, records = train_router(remote, PROMPTS[:3], candidates, max_new_tokens=12, progress=False)
        assert set(records["method"]) == {"server-only-ar", f"server-only@{far}"}
        path = router.save(tmp_path / "router.json")
    finally:
        allowed.stop()
    router.margin, router.default = float("inf"), candidates[1].label  # always the candidate with its own draft
    router.by_family = False
    router.save(path)
    routed, refusing = ThreadWorker(router=str(path), allow_load=(far,)), ThreadWorker(router=str(path))
    try:
        got = run(RemoteTarget(routed.endpoint), PROMPTS[:3], method="auto-server", max_new_tokens=12,
                  progress=False)
        with pytest.raises(WorkerError, match="--allow-load"):
            run(RemoteTarget(refusing.endpoint), PROMPTS[:1], method="auto-server", max_new_tokens=8, progress=False)
    finally:
        routed.stop()
        refusing.stop()
    local = outputs(run(tiny_target, PROMPTS[:3], method="target-only", max_new_tokens=12, progress=False))
    assert [outputs(got)[("auto-server", i)] for i in range(3)] == [local[("target-only", i)] for i in range(3)]
    assert set(got["chosen"]) == {f"server-only@{far} k=3"}
