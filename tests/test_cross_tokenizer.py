"""Drafts from a model with another tokenizer: text carried across exactly, greedy output identical
to target-only, the shared-vocabulary rule exact in distribution, refusals that say what works."""
import numpy as np
import pytest
import torch

from specbench.api import encode_prompts, outputs, run
from specbench.decode.cross_drafters import CrossTokenizerDrafter
from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.methods import DraftSource, make_drafter
from specbench.models.loading import VocabMismatchError
from specbench.models.tiny import tiny_model
from specbench.models.vocab_bridge import SharedVocab, TextBridge, token_keys
from specbench.sampling.streams import DraftDraws
from specbench.types import SamplingParams, SpecbenchError
from tests.test_distributions import P_VALUE_FLOOR, chi_square_p
from tests.tokenizers_for_tests import (byte_level_bpe, permuted, sentencepiece_bpe,
                                        tiny_with_tokenizer)

TEXTS = ["hello world, hello there", "def add(a, b):\n    return a + b", "naïve café 東京 résumé!",
         "  two  spaces\tand a tab", "for i in range(10):"]


@pytest.fixture(scope="module")
def byte_level():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def sentencepiece():
    return sentencepiece_bpe(specials=("<eos>", "<|im_end|>"))


def test_shared_vocabulary_pairs_tokens_that_spell_the_same_bytes(byte_level, sentencepiece):
    shared = SharedVocab.build(sentencepiece, len(sentencepiece), byte_level, len(byte_level))
    draft_keys, target_keys = token_keys(sentencepiece, len(sentencepiece)), token_keys(byte_level, len(byte_level))
    assert len(set(shared.draft_ids.tolist())) == len(set(shared.target_ids.tolist())) == len(shared) > 100
    for d, t in zip(shared.draft_ids.tolist(), shared.target_ids.tolist()):
        assert draft_keys[d] == target_keys[t]
    # "▁" and "Ġ" both spell a space; "<0xE6>" (byte fallback) and "æ" (byte level) both spell byte 0xE6
    space_d, space_t = sentencepiece.convert_tokens_to_ids("\u2581"), byte_level.convert_tokens_to_ids("\u0120")
    assert shared.draft_to_target[space_d] == space_t
    assert shared.draft_to_target[sentencepiece.convert_tokens_to_ids("<0xE6>")] == byte_level.convert_tokens_to_ids("æ")
    assert shared.draft_to_target[sentencepiece.convert_tokens_to_ids("<|im_end|>")] == \
        byte_level.convert_tokens_to_ids("<|im_end|>")
    assert sentencepiece.convert_tokens_to_ids("<eos>") not in shared.draft_to_target  # the target has no "<eos>"


@pytest.mark.parametrize("text", TEXTS)
def test_text_crosses_both_ways_exactly(byte_level, sentencepiece, text):
    """Context to the draft and new draft text to the target lose nothing: spaces, tabs, accents,
    characters the draft spells in bytes, tokens that split or merge across the two vocabularies."""
    bridge = TextBridge(sentencepiece, byte_level)
    target_ids = byte_level(text, add_special_tokens=False)["input_ids"]
    draft_ids = bridge.to_draft(target_ids)
    assert sentencepiece.decode(draft_ids) == text
    for cut in range(1, len(draft_ids)):
        new_text = bridge.new_text(draft_ids[:cut], draft_ids[cut:])
        assert byte_level.decode(bridge.to_target(new_text)) == new_text
        assert text.endswith(new_text) and len(new_text) <= len(text)


def test_tokens_split_and_merge_across_vocabularies(byte_level, sentencepiece):
    """The texts have draft tokens spanning several target tokens and the other way round."""
    def spanning(draft_tokenizer, target_tokenizer):
        bridge, count = TextBridge(draft_tokenizer, target_tokenizer), 0
        for text in TEXTS:
            ids = draft_tokenizer(text, add_special_tokens=False)["input_ids"]
            count += sum(len(bridge.to_target(bridge.new_text(ids[:cut], ids[cut:cut + 1]))) > 1
                         for cut in range(len(ids)))
        return count

    assert spanning(sentencepiece, byte_level) > 0 and spanning(byte_level, sentencepiece) > 0


def test_a_character_split_into_bytes_is_withheld_until_complete(byte_level, sentencepiece):
    bridge = TextBridge(sentencepiece, byte_level)
    ids = sentencepiece("x 東", add_special_tokens=False)["input_ids"]
    first_byte = sentencepiece.convert_ids_to_tokens(ids).index("<0xE6>")
    assert bridge.new_text(ids[:first_byte], ids[first_byte:first_byte + 2]) == ""
    assert bridge.new_text(ids[:first_byte], ids[first_byte:first_byte + 3]) == "東"


class Scripted:
    """Stands in for the draft model: its logits pick the scripted draft tokens one after another."""

    def __init__(self, drafter: CrossTokenizerDrafter, script):
        self.script, self.vocab = list(script), drafter.draft.vocab_size
        drafter.model_drafter._sync = lambda context: self._next()
        drafter.model_drafter._extend = lambda tokens: self._next()

    def _next(self):
        logits = torch.zeros(self.vocab)
        logits[self.script.pop(0) if self.script else 0] = 10.0
        return logits


def scripted_chain(draft_tokenizer, target_tokenizer, script_text_ids, k):
    draft = tiny_with_tokenizer(draft_tokenizer, seed=0)
    drafter = CrossTokenizerDrafter(draft, target_tokenizer, len(target_tokenizer), rule="text", slack=4)
    Scripted(drafter, script_text_ids)
    context = target_tokenizer("hello", add_special_tokens=False)["input_ids"]
    return drafter.propose(context, k, SamplingParams(), DraftDraws(0))


def test_eos_the_target_lacks_ends_the_proposal_before_it(byte_level, sentencepiece):
    script = sentencepiece(" world, hello", add_special_tokens=False)["input_ids"][:3]
    tree = scripted_chain(sentencepiece, byte_level, script + [sentencepiece.convert_tokens_to_ids("<eos>")], k=8)
    text = sentencepiece.decode(script)
    assert byte_level.decode(list(tree.tokens)) == text
    assert tree.draft_tokens == len(script) + 1 and tree.cross_tokenizer == "text"


def test_a_marker_both_tokenizers_know_is_proposed_as_the_targets_own(byte_level, sentencepiece):
    marker = byte_level.convert_tokens_to_ids("<|im_end|>")
    script = byte_level(" world", add_special_tokens=False)["input_ids"] + [marker]
    tree = scripted_chain(byte_level, sentencepiece, script, k=8)
    assert tree.tokens[-1] == sentencepiece.convert_tokens_to_ids("<|im_end|>")
    assert sentencepiece.decode(list(tree.tokens[:-1])) == " world"


def test_chain_proposes_k_target_tokens_ending_where_the_draft_text_went_on(byte_level, sentencepiece):
    script = sentencepiece(" world, hello there, world peace", add_special_tokens=False)["input_ids"]
    tree = scripted_chain(sentencepiece, byte_level, script, k=3)
    full = byte_level(sentencepiece.decode(script), add_special_tokens=False)["input_ids"]
    assert list(tree.tokens) == full[:3] and tree.parents == (-1, 0, 1)


TINY_PROMPTS = ["hello world, hello", "def add(a, b):", "The quick brown fox"]


@pytest.fixture(scope="module")
def ascii_level():
    return byte_level_bpe(vocab_size=120, ascii_only=True)


@pytest.fixture(scope="module")
def tiny_pair(ascii_level):
    """A tiny target and its vocabulary-permuted twin (same text model, every id different)."""
    target = tiny_with_tokenizer(ascii_level, seed=3)
    return target, permuted(target, seed=1)


@pytest.mark.parametrize("method,rule", [("chain", "text"), ("tree", "text"), ("fixed-tree", "text"),
                                         ("chain", "shared-vocab")])
def test_greedy_output_is_target_only_token_for_token(tiny_pair, method, rule):
    target, draft = tiny_pair
    frame = run(target, TINY_PROMPTS, method=["target-only", method], draft=draft, k=6, max_new_tokens=24,
                progress=False, chat=False, cross_tokenizer=rule)
    got = outputs(frame)
    for index in range(len(TINY_PROMPTS)):
        assert got[(method, index)] == got[("target-only", index)]
    drafted = frame[frame["method"] == method]
    assert set(drafted.loc[drafted["drafted"] > 0, "cross_tokenizer"]) == {rule}
    # the twin reads the same text, so translation through text must be accepted often
    steps = drafted[drafted["drafted"] > 0]
    assert steps["accepted"].mean() >= 1.0, steps["accepted"].tolist()


@pytest.mark.parametrize("rule", ["text", "shared-vocab"])
def test_a_confident_chain_across_tokenizers_stops_on_its_own_tokens_and_stays_lossless(tiny_pair, rule):
    """chain-confident with a draft of another tokenizer: the stop reads the draft's own tokens' probabilities,
    so chains end earlier than the plain chain's at the same cap, and the output is still target-only's (and the
    hybrid's that drafts with that chain where suffix decoding does not vouch)."""
    target, draft = tiny_pair
    hybrid = "suffix-tree-chain-confident"
    frame = run(target, TINY_PROMPTS, method=["target-only", "chain", "chain-confident", hybrid], draft=draft, k=6,
                max_new_tokens=24, progress=False, chat=False, cross_tokenizer=rule, stop_below=0.3)
    got = outputs(frame)
    for index in range(len(TINY_PROMPTS)):
        assert got[("chain-confident", index)] == got[("target-only", index)]
        assert got[(hybrid, index)] == got[("target-only", index)]
    # its model steps drafted across tokenizers (its suffix steps, in the target's own ids, record none)
    assert rule in set(frame.loc[(frame["method"] == hybrid) & (frame["drafted"] > 0), "cross_tokenizer"])
    drafted = frame[frame["drafted"] > 0].groupby("method")["draft_tokens"].mean()
    assert drafted["chain-confident"] < drafted["chain"], drafted.to_dict()


@pytest.mark.parametrize("rule", ["text", "shared-vocab"])
def test_a_cross_chain_draft_runs_the_fast_path(tiny_pair, rule):
    """With `fast`, the draft of another tokenizer steps through fixed shapes on a static cache of its own
    ids (its re-synced context included) and the output is still target-only's, token for token."""
    target, draft = tiny_pair
    frame = run(target, TINY_PROMPTS, method=["target-only", "chain"], draft=draft, k=6, max_new_tokens=24,
                progress=False, chat=False, cross_tokenizer=rule, fast="static")
    got = outputs(frame)
    for index in range(len(TINY_PROMPTS)):
        assert got[("chain", index)] == got[("target-only", index)]
    drafter = make_drafter("chain", DraftSource(LocalTarget(target), target, draft, cross_tokenizer=rule, fast="static"))
    assert drafter.model_drafter.fast is not None and drafter.model_drafter.fast.backend == "static"
    drafter.propose(target.tokenizer.encode(TINY_PROMPTS[0]), 4, SamplingParams(), torch.Generator().manual_seed(0))
    assert drafter.model_drafter.fast.shapes  # the draft's steps went through the static shapes


def test_unrelated_draft_with_another_tokenizer_is_still_lossless(ascii_level, sentencepiece):
    target = tiny_with_tokenizer(ascii_level, seed=5)
    draft = tiny_with_tokenizer(sentencepiece, seed=6)
    for method in ("chain", "tree"):
        frame = run(target, TINY_PROMPTS, method=["target-only", method], draft=draft, k=4, max_new_tokens=16,
                    progress=False, chat=False)
        got = outputs(frame)
        assert all(got[(method, i)] == got[("target-only", i)] for i in range(len(TINY_PROMPTS)))


def test_shared_vocabulary_rejection_keeps_the_target_distribution(ascii_level):
    """First emitted token of sampled SD with the shared-vocabulary rule follows the target's p;
    the same test rejects the draft's own proposals (negative control)."""
    byte_level = ascii_level
    target = tiny_with_tokenizer(byte_level, seed=3)
    noisy = tiny_model(seed=4, vocab_size=len(byte_level), noise_from=target, noise_scale=0.05)
    noisy.tokenizer = byte_level
    draft = permuted(noisy, seed=2)
    sampling = SamplingParams(temperature=2.0, rule="rejection", draft_top_k=16)
    drafter = CrossTokenizerDrafter(draft, byte_level, len(byte_level), rule="auto")
    local = LocalTarget(target)
    prompt = byte_level("hello world, hello", add_special_tokens=False)["input_ids"]
    counts, drafted_counts = np.zeros(len(byte_level)), np.zeros(len(byte_level))
    accepted = 0
    for draw in range(1000):
        result = generate(local, drafter, prompt, Decoding(3, 2, sampling), seed=900 + draw)
        accepted += sum(r.accepted for r in result.records)
        counts[result.output_ids[0]] += 1
        drafted_counts[drafter.propose(prompt, 1, sampling, DraftDraws(900 + draw)).tokens[0]] += 1
    assert {r.cross_tokenizer for r in result.records if r.drafted} == {"shared-vocab"}
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt])).logits[0, -1:]
    from specbench.sampling.probs import processed_probs

    p = processed_probs(logits, sampling)[0].double().numpy()
    assert accepted > 200, "the draft must be accepted often for the test to exercise acceptance"
    assert chi_square_p(counts, p) > P_VALUE_FLOOR
    assert chi_square_p(drafted_counts, p) < P_VALUE_FLOOR


def test_refusals_say_what_would_work(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(VocabMismatchError, match="cross_tokenizer is not 'off'"):
        run(target, TINY_PROMPTS[:1], method="chain", draft=draft, progress=False, chat=False, cross_tokenizer="off")
    with pytest.raises(SpecbenchError, match="sample-match"):
        run(target, TINY_PROMPTS[:1], method="chain", draft=draft, progress=False, chat=False,
            cross_tokenizer="text", sampling=SamplingParams(temperature=1.0, rule="rejection"))
    with pytest.raises(SpecbenchError, match="drafts chains"):
        run(target, TINY_PROMPTS[:1], method="tree", draft=draft, progress=False, chat=False,
            cross_tokenizer="shared-vocab")
    with pytest.raises(SpecbenchError, match="cross_tokenizer must be one of"):
        run(target, TINY_PROMPTS[:1], method="chain", draft=draft, progress=False, chat=False, cross_tokenizer="maybe")
    no_tokenizer = tiny_model(seed=9, vocab_size=50)
    with pytest.raises(VocabMismatchError, match="output ids"):
        run(target, TINY_PROMPTS[:1], method="chain", draft=no_tokenizer, progress=False, chat=False)


def test_smollm2_under_shuffled_ids_drafts_for_itself_through_text(smollm2):
    """Real text and chat markers: SmolLM2 drafting for itself under shuffled ids (every id means
    another token) goes through text and back, so it must be accepted (nearly) always; only where
    the target writes a non-canonical tokenization can the re-tokenized draft differ."""
    twin = permuted(smollm2, seed=5)
    prompts = ["Write a haiku about the sea.", "What is 12 times 7? Explain."]
    frame = run(smollm2, prompts, method=["target-only", "chain"], draft=twin, k=4, max_new_tokens=24,
                progress=False, warmup=False)
    got = outputs(frame)
    assert all(got[("chain", i)] == got[("target-only", i)] for i in range(len(prompts)))
    drafting = frame[(frame["method"] == "chain") & (frame["drafted"] > 0)]
    assert drafting["accepted"].sum() >= 0.9 * drafting["drafted"].sum()
    assert set(drafting["cross_tokenizer"]) == {"text"} and (drafting["draft_tokens"] >= drafting["drafted"]).all()


def test_remote_target_with_a_draft_of_another_tokenizer(smollm2):
    """Through the worker: the draft stays here and translates with the target's tokenizer, which the client
    was not given: it comes from the worker (op "tokenizer") and encodes text as the target's own does."""
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget
    from worker_helpers import ThreadWorker

    running = ThreadWorker(model=ModelSpec("smollm2-135m"), draft=None)
    try:
        prompts = ["Name three colours."]
        twin = permuted(smollm2, seed=5)
        with pytest.raises(VocabMismatchError, match="both tokenizers are known"):
            run(RemoteTarget(running.endpoint), [[1, 2, 3]], method="chain", draft=tiny_model(0, vocab_size=64),
                progress=False)
        remote = RemoteTarget(running.endpoint)
        assert encode_prompts(prompts + ["def f(x):"], remote.tokenizer) == encode_prompts(
            prompts + ["def f(x):"], smollm2.tokenizer)  # the chat template came too
        assert RemoteTarget(running.endpoint).tokenizer is remote.tokenizer  # fetched once per model, per process
        frame = run(remote, prompts, method="chain", draft=twin, k=4, max_new_tokens=16, progress=False, warmup=False)
        local = run(smollm2, prompts, method="target-only", max_new_tokens=16, progress=False,
                    warmup=False)
        assert outputs(frame)[("chain", 0)] == outputs(local)[("target-only", 0)]
        drafting = frame[frame["drafted"] > 0]
        assert drafting["accepted"].sum() >= 0.9 * drafting["drafted"].sum()
    finally:
        running.stop()


def test_reference_of_a_cross_pair_round_trips_and_prices_the_drafts_forwards(tiny_pair, tmp_path):
    from dataclasses import replace

    from specbench.plan.library import load_references, save_reference
    from specbench.plan.predict import LatencyProfile, OperatingPoint, predict_step
    from specbench.record import record_reference

    target, draft = tiny_pair
    reference = record_reference(target, draft, TINY_PROMPTS, dataset="tiny", max_chain=4, max_new_tokens=12)
    assert reference.cross_tokenizer == "text" and reference.draft_per_target >= 1.0
    save_reference(reference, folder=tmp_path)
    (loaded,) = load_references(tmp_path)
    assert (loaded.cross_tokenizer, loaded.draft_per_target) == (reference.cross_tokenizer, reference.draft_per_target)
    profile = LatencyProfile("m", "cpu", rows=((1, 256, 0.01), (4, 256, 0.02), (8, 256, 0.03)))
    point = OperatingPoint("chain", 4)
    one, more = (predict_step(point, profile, profile, replace(loaded, draft_per_target=r)) for r in (1.0, 1.5))
    assert more.draft_s > one.draft_s


def test_server_only_drafts_across_tokenizers_on_the_worker(tiny_pair, tmp_path):
    """The worker's own draft may have another tokenizer: `server-only` translates through text
    there, and its output is the target's alone. Both models are loaded from local folders."""
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget
    from worker_helpers import ThreadWorker

    target, draft = tiny_pair
    for loaded, folder in ((target, tmp_path / "target"), (draft, tmp_path / "draft")):
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    running = ThreadWorker(model=ModelSpec(str(tmp_path / "target")), draft=ModelSpec(str(tmp_path / "draft")))
    try:
        prompts = [target.tokenizer(text)["input_ids"] for text in TINY_PROMPTS]
        frame = run(RemoteTarget(running.endpoint), prompts, method="server-only", k=6, max_new_tokens=24,
                    progress=False)
        local = run(target, prompts, method="target-only", max_new_tokens=24, progress=False)
        for index in range(len(prompts)):
            assert outputs(frame)[("server-only", index)] == outputs(local)[("target-only", index)]
        drafting = frame[frame["drafted"] > 0]
        assert len(drafting) and set(drafting["cross_tokenizer"]) == {"text"}
        assert drafting["accepted"].mean() >= 1.0  # the twin reads the same text: translation must be accepted
    finally:
        running.stop()
