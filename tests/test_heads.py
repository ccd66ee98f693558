"""Draft heads (EAGLE-3's shape): lossless drafting from the target's features, both published layouts
written and read back, a head shaped like a published one, and heads that do not fit refused by name."""
import json

import pytest
import torch

from specbench.api import outputs, run
from specbench.decode.target import LocalTarget
from specbench.heads.build import new_head
from specbench.heads.layouts import load_head, save_head
from specbench.models.tiny import tiny_model
from specbench.types import SamplingParams, SpecbenchError

PROMPTS = [[(i * 7 + j * 5) % 90 + 3 for j in range(9)] for i in range(4)]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, num_layers=4)


def test_a_head_drafts_losslessly_and_reads_every_committed_position(target):
    """Greedy SD with a head equals target-only token for token (fp32); the target keeps one feature row
    per cached position, and the head reads them without a second target forward."""
    head = new_head(target, seed=3)
    local = LocalTarget(target)
    records = run(local, PROMPTS, method=["target-only", "eagle", "eagle-tree"], draft=head, k=4, max_new_tokens=24,
                  progress=False, warmup=False)
    got = outputs(records)
    for index in range(len(PROMPTS)):
        assert got[("eagle", index)] == got[("target-only", index)] == got[("eagle-tree", index)]
    same = tiny_model(seed=0, num_layers=4)  # a model of its own: one tap per model, and this head reads other layers
    final = new_head(same, layer_ids=(1, 4), seed=3)  # 4: the final hidden state
    tapped = outputs(run(LocalTarget(same), PROMPTS, method="eagle", draft=final, k=4, max_new_tokens=24,
                         progress=False, warmup=False))
    assert all(tapped[("eagle", i)] == got[("target-only", i)] for i in range(len(PROMPTS)))
    trees = records[records["method"] == "eagle-tree"]
    assert trees["drafted"].max() == 4 and (trees["tree_depth"] < 4).any()  # a tree: siblings, not only a chain
    steps = records[records["method"] == "eagle"]
    assert (steps["drafted"] == 4).mean() > 0.5 and steps["drafted"].max() == 4
    local.keep_features("probe", head.config.layer_ids)
    local.prefill("probe", PROMPTS[0])
    local.prefill("other", PROMPTS[1])
    assert len(local.features("probe")) == len(PROMPTS[0]) - 1
    assert local.features("probe")[0].shape == (3 * 64,)
    assert local.state("other").features is None  # only the sessions a head drafts for keep features
    with pytest.raises(SpecbenchError, match="keeps no features"):
        local.features("other")


def test_a_head_method_runs_its_target_eager_where_the_default_would_be_fast(target, monkeypatch):
    """On CUDA the default (fast=None) is the fast path, whose fixed-shape steps expose no hidden states:
    `run` builds the target eager for a head method instead of refusing it; an explicit fast stays refused."""
    from specbench.decode import fast_forward

    plain = fast_forward.chosen_backend
    monkeypatch.setattr(fast_forward, "chosen_backend", lambda fast, model: "static" if fast is None
                        else plain(fast, model))  # what a CUDA model gets by default
    head = new_head(target, seed=3)
    records = run(target, PROMPTS[:2], method=["target-only", "eagle"], draft=head, k=4, max_new_tokens=12,
                  progress=False, warmup=False)
    got = outputs(records)
    assert all(got[("eagle", i)] == got[("target-only", i)] for i in range(2))
    with pytest.raises(SpecbenchError, match="fast=False"):
        run(target, PROMPTS[:1], method="eagle", draft=head, k=4, max_new_tokens=4, fast="static", progress=False,
            warmup=False)


def test_batched_verifies_keep_each_sessions_features_as_one_forward_over_its_tokens(target):
    """Features kept through batched verifies (packed into one sequence, and padded), with a prefill
    chunk riding along, equal those of one forward over each session's committed tokens."""
    from specbench.decode.batch import VerifyRequest, verify_batch
    from specbench.types import DraftTree

    head = new_head(target, seed=3)
    for kv_pool in (True, False):
        local = LocalTarget(target, kv_pool=kv_pool)
        for index, prompt in enumerate(PROMPTS[:3]):
            local.keep_features(f"s{index}", head.config.layer_ids)
            local.prefill(f"s{index}", prompt)
        local.prefill("plain", PROMPTS[3])
        job = None
        if local.packed:
            local.keep_features("chunked", head.config.layer_ids)
            job = local.prefill_job("chunked", PROMPTS[3] + PROMPTS[0])
        for step in range(3):
            requests = [VerifyRequest(f"s{i}", DraftTree.chain([(i + step) % 90 + 3, 5 + step]), SamplingParams(), 0)
                        for i in range(3)] + [VerifyRequest("plain", DraftTree.chain([7]), SamplingParams(), 0)]
            verdicts = verify_batch(local, requests, [(job, 4)] if job else ())
            assert not any(isinstance(v, Exception) for v in verdicts)
        if job:
            job.advance(64)
        reference = LocalTarget(target, kv_pool=False)
        for name in ["s0", "s1", "s2"] + (["chunked"] if job else []):
            committed = local.committed(name)
            reference.keep_features("again", head.config.layer_ids)
            reference.prefill("again", committed)
            expected, got = torch.stack(reference.features("again")), torch.stack(local.features(name))
            assert got.shape == expected.shape == (len(committed) - 1, 3 * 64)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            reference.close("again")
        assert local.state("plain").features is None


@pytest.mark.parametrize("method,rule", [("eagle", "rejection"), ("eagle-tree", "sample-match")])
def test_sampled_drafting_with_a_head_keeps_the_targets_distribution(method, rule):
    """Rejection sampling with the head's reported q (real caches, real features): the first two emitted
    tokens follow the target's exact marginals (chi-square), with the head accepted often enough to
    exercise acceptance."""
    from specbench.decode.loop import Decoding
    from specbench.methods import DraftSource, make_drafter
    from tests.test_distributions import check_two_token_marginals

    vocab = 16
    target = tiny_model(seed=3, vocab_size=vocab)
    sampling = SamplingParams(temperature=1.5, rule=rule, draft_top_k=8)
    local = LocalTarget(target)
    drafter = make_drafter(method, DraftSource(local, target, new_head(target, seed=6)))
    check_two_token_marginals(local, target, drafter, Decoding(3 if method == "eagle" else 6, 2, sampling), vocab)


def test_suffix_with_a_head_drafts_each_step_from_whichever_vouches_and_stays_lossless(target):
    """`suffix-eagle`: a step whose suffix proposal expects at least `hand_over` accepted tokens is drafted
    by suffix decoding, every other by the head; on prompts that repeat themselves both draft, and greedy
    output equals target-only token for token, chains and trees."""
    from specbench.decode.loop import Decoding, generate
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.methods import DraftSource, make_drafter

    head = new_head(target, seed=3)
    prompts = PROMPTS + [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [11]]
    local = LocalTarget(target)
    records = run(local, prompts, method=["target-only", "suffix-eagle", "suffix-eagle-tree"], draft=head, k=4,
                  max_new_tokens=24, progress=False, warmup=False)
    got = outputs(records)
    for index in range(len(prompts)):
        assert got[("suffix-eagle", index)] == got[("target-only", index)] == got[("suffix-eagle-tree", index)]
    for method in ("suffix-eagle", "suffix-eagle-tree"):
        drafter = make_drafter(method, DraftSource(local, target, head, suffix=SuffixSettings(cache="drafter")))
        for index, prompt in enumerate(prompts):
            assert generate(local, drafter, prompt, Decoding(4, 24)).output_ids == got[("target-only", index)]
        assert drafter.steps["suffix"] > 0 and drafter.steps["other"] > 0, drafter.steps
    never = make_drafter("suffix-eagle", DraftSource(local, target, head,
                                                     suffix=SuffixSettings(hand_over=99.0, bench_below=0)))
    generate(local, never, prompts[-1], Decoding(4, 12))
    assert never.steps["suffix"] == 0 and never.steps["other"] > 0
    with pytest.raises(SpecbenchError, match="needs a draft head"):
        make_drafter("suffix-eagle", DraftSource(local, target, None))


def test_a_head_hybrid_benches_its_head_by_default_and_a_draft_model_hybrid_does_not(target):
    """`SuffixSettings.bench_below` unset: 0.3 behind a head (benched in a request where its drafts fail: this
    untrained head's, after a few steps), 0 behind a draft model; set, it is taken as it is, 0 included."""
    from specbench.decode.loop import Decoding, generate
    from specbench.decode.suffix_drafter import HEAD_BENCH_BELOW, SuffixSettings
    from specbench.methods import DraftSource, make_drafter

    head, local = new_head(target, seed=3), LocalTarget(target)
    prompt = [11, 12, 13] * 5 + [11]
    benched = {}
    for setting in (None, 0.0, 0.6):
        drafter = make_drafter("suffix-eagle", DraftSource(local, target, head, suffix=SuffixSettings(
            cache="drafter", hand_over=99.0, bench_below=setting)))
        assert drafter.bench_below == (HEAD_BENCH_BELOW if setting is None else setting) and HEAD_BENCH_BELOW == 0.3
        generate(local, drafter, prompt, Decoding(4, 16))
        benched[setting] = drafter.benched
    assert benched[0.0] == 0 and 0 < benched[None] <= benched[0.6], benched
    model = make_drafter("suffix-chain", DraftSource(local, target, target, suffix=SuffixSettings()))
    assert model.bench_below == 0.0
    model = make_drafter("suffix-chain", DraftSource(local, target, target, suffix=SuffixSettings(bench_below=0.3)))
    assert model.bench_below == 0.3


@pytest.mark.parametrize("method,rule,hand_over", [("suffix-eagle", "rejection", 1.0),
                                                   ("suffix-eagle-tree", "sample-match", 0.5)])
def test_sampled_drafting_with_suffix_and_a_head_keeps_the_targets_distribution(method, rule, hand_over):
    """Each step's proposal carries its own drafter's q (a point mass for suffix decoding, the head's
    distribution otherwise), and which drafter proposes is a function of the context: the first two
    tokens follow the target's marginals (chi-square) with both drafters proposing across the draws."""
    from specbench.decode.loop import Decoding
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.methods import DraftSource, make_drafter
    from tests.test_distributions import check_two_token_marginals

    vocab = 16
    target = tiny_model(seed=3, vocab_size=vocab)
    sampling = SamplingParams(temperature=1.5, rule=rule, draft_top_k=8)
    local = LocalTarget(target)
    drafter = make_drafter(method, DraftSource(local, target, new_head(target, seed=6),
                                               suffix=SuffixSettings(cache="drafter", hand_over=hand_over)))
    check_two_token_marginals(local, target, drafter, Decoding(3 if method == "suffix-eagle" else 6, 4, sampling),
                              vocab)
    assert min(drafter.steps.values()) > 100, drafter.steps


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_each_published_layout_writes_and_reads_back_the_same_head(target, tmp_path, layout):
    head = new_head(target, draft_ids=range(0, 96, 2), seed=2)
    folder = save_head(head, tmp_path / layout, layout=layout, target_name="tiny")
    document = json.loads((folder / "config.json").read_text())
    assert ("speculators_model_type" in document) == (layout == "speculators")
    loaded = load_head(folder, target)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    records = run(LocalTarget(target), PROMPTS[:2], method=["target-only", "eagle"], draft=str(folder), k=3,
                  max_new_tokens=12, progress=False, warmup=False)
    got = outputs(records)
    assert got[("eagle", 0)] == got[("target-only", 0)] and got[("eagle", 1)] == got[("target-only", 1)]
    assert set(records.loc[records["method"] == "eagle", "drafted"]) - {0} <= {1, 2, 3}


def test_a_head_shaped_like_a_published_config_loads_and_drafts(tmp_path):
    """The config of a published EAGLE-3 head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's fields: Llama-3.1
    rope scaling, a 32K draft vocabulary of a 128K target, no embeddings of its own) with its sizes
    scaled down to a matching tiny Llama target, random weights: it loads, maps draft ids to target ids,
    and drafts losslessly."""
    from safetensors.torch import save_file

    target = tiny_model(seed=4, vocab_size=256, hidden_size=64, num_layers=6)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
              "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
              "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.47.1", "use_cache": True, "vocab_size": 256, "draft_vocab_size": 64}
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (64, 192), "midlayer.hidden_norm.weight": (64,), "midlayer.input_layernorm.weight": (64,),
              "midlayer.post_attention_layernorm.weight": (64,), "midlayer.self_attn.q_proj.weight": (64, 128),
              "midlayer.self_attn.k_proj.weight": (32, 128), "midlayer.self_attn.v_proj.weight": (32, 128),
              "midlayer.self_attn.o_proj.weight": (64, 64), "midlayer.mlp.gate_proj.weight": (128, 64),
              "midlayer.mlp.up_proj.weight": (128, 64), "midlayer.mlp.down_proj.weight": (64, 128),
              "norm.weight": (64,), "lm_head.weight": (64, 64)}
    state = {name: torch.randn(shape, generator=generator) * 0.2 for name, shape in shapes.items()}
    kept = torch.arange(0, 256, 4)
    state["d2t"] = kept - torch.arange(64)
    state["t2d"] = torch.zeros(256, dtype=torch.bool).index_fill(0, kept, True)
    save_file(state, str(folder / "model.safetensors"))
    head = load_head(folder, target)
    assert head.config.layer_ids == (2, 3, 3) and head.config.draft_vocab_size == 64
    assert torch.equal(head.draft_to_target, kept) and head.embed_tokens is target.model.get_input_embeddings()
    records = run(LocalTarget(target), PROMPTS[:2], method=["target-only", "eagle"], draft=str(folder), k=4,
                  max_new_tokens=16, progress=False, warmup=False)
    got = outputs(records)
    assert got[("eagle", 0)] == got[("target-only", 0)] and got[("eagle", 1)] == got[("target-only", 1)]
    drafted = records[records["method"] == "eagle"]
    assert drafted["drafted"].max() == 4


def test_heads_that_do_not_fit_the_target_are_refused_by_name(target, tmp_path):
    head = new_head(target, seed=2)
    folder = save_head(head, tmp_path / "head")
    other_vocab = tiny_model(seed=0, vocab_size=128, num_layers=4)
    with pytest.raises(SpecbenchError, match="vocabulary has 96 ids, the target's 128"):
        load_head(folder, other_vocab)
    wider = tiny_model(seed=0, hidden_size=32, num_layers=4)
    with pytest.raises(SpecbenchError, match="features of size 64, the target's hidden size is 32"):
        load_head(folder, wider)
    shallow = tiny_model(seed=0, num_layers=1)
    with pytest.raises(SpecbenchError, match=r"reads target layers \[2, 2, 1\], but the target has 1"):
        load_head(folder, shallow)
    (tmp_path / "not-a-head").mkdir()
    (tmp_path / "not-a-head" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SpecbenchError, match="not a draft head specbench reads"):
        load_head(tmp_path / "not-a-head", target)
    with pytest.raises(SpecbenchError, match="not a folder here"):
        load_head(tmp_path / "nowhere", target)
    with pytest.raises(SpecbenchError, match="needs a draft head"):
        run(LocalTarget(target), PROMPTS[:1], method="eagle", max_new_tokens=4, progress=False, warmup=False)
    from specbench.heads.features import FeatureTap

    normless = tiny_model(seed=0, num_layers=4).model
    normless.model.norm = None
    with pytest.raises(SpecbenchError, match=r"reading layer 4 \(the final hidden state\) taps the target's final"):
        FeatureTap(normless, (1, 4))


@pytest.mark.parametrize("layer_ids", [None, (0, 2, 4)])
def test_the_head_reads_position_t_with_token_t_plus_1_and_the_targets_layer_inputs_at_t(target, layer_ids):
    """After a prefill and two verified steps, the drafter's incremental state (features kept by the tap
    per verify, the head's cache fed piece by piece, drafted positions dropped) equals one pass of the
    head over the whole context with the layer inputs Hugging Face reports (`hidden_states[i]`; id 4 of
    this 4-layer target: the final hidden state, as training reads it)."""
    from specbench.heads.model import HeadCache
    from specbench.methods import DraftSource, make_drafter
    from specbench.sampling.streams import Streams

    if layer_ids:
        target = tiny_model(seed=0, num_layers=4)  # a model of its own: one tap per model
    head = new_head(target, layer_ids=layer_ids, seed=7)
    local = LocalTarget(target)
    drafter = make_drafter("eagle", DraftSource(local, target, head))
    drafter.bind(local, "s")
    local.prefill("s", PROMPTS[1])
    streams, greedy = Streams(0), SamplingParams()
    for _ in range(2):
        context = local.committed("s")
        tree = drafter.propose(context, 3, greedy, streams.draft)
        local.verify("s", tree, greedy, 0)
    context = local.committed("s")
    drafter.propose(context, 2, greedy, streams.draft)
    with torch.no_grad():
        states = target.model(torch.tensor([context]), output_hidden_states=True).hidden_states
        raw = torch.cat([states[i][0] for i in head.config.layer_ids], dim=-1)[:-1]
        positions = torch.arange(len(context) - 1)
        _, logits = head(torch.tensor(context[1:]), head.fuse(raw), positions, HeadCache())
    assert drafter.cache.length >= len(context) - 1
    torch.testing.assert_close(drafter.last[1], logits[-1], rtol=1e-4, atol=1e-4)


def test_the_training_time_test_unroll_sees_what_drafting_sees(target):
    """Step 0 of the unroll is the head over the real features; step j at base p equals drafting j
    tokens past real position p with the head's cache (its own outputs as features), so what the head
    is trained on is what it is asked at draft time."""
    from specbench.heads.model import HeadCache
    from specbench.heads.train import unrolled_logits

    head = new_head(target, draft_ids=range(0, 96, 3), seed=8)
    ids = torch.tensor(PROMPTS[2] + PROMPTS[3][:5])
    with torch.no_grad():
        states = target.model(ids[None], output_hidden_states=True).hidden_states
        features = head.fuse(torch.cat([states[i][0] for i in head.config.layer_ids], dim=-1)[:-1])
        steps = unrolled_logits(head, ids, features, 3)
        n = features.shape[0]
        _, whole = head(ids[1:], features, torch.arange(n), HeadCache())
        torch.testing.assert_close(steps[0], whole, rtol=1e-4, atol=1e-4)
        for base in (0, 4, n - 3):
            cache = HeadCache()
            hidden, _ = head(ids[1:base + 2], features[:base + 1], torch.arange(base + 1), cache)
            feature = hidden[-1:]
            for j in (1, 2):
                feature, logits = head(ids[base + 1 + j:base + 2 + j], feature, torch.tensor([base + j]), cache)
                torch.testing.assert_close(steps[j][base], logits[0], rtol=1e-4, atol=1e-4)


def test_the_unroll_from_a_prompts_end_predicts_what_the_whole_unroll_predicts_there(target):
    """Training on replies only (`start`: the prompt's positions serve as keys alone) changes no logit it
    keeps: every step equals the whole unroll's rows from `start` on, and the labels line up with them."""
    from specbench.heads.train import unrolled_logits

    head = new_head(target, draft_ids=range(0, 96, 3), seed=8)
    ids = torch.tensor(PROMPTS[2] + PROMPTS[3])
    with torch.no_grad():
        states = target.model(ids[None], output_hidden_states=True).hidden_states
        features = head.fuse(torch.cat([states[i][0] for i in head.config.layer_ids], dim=-1)[:-1])
        whole = unrolled_logits(head, ids, features, 4)
        for start in (1, 5, len(ids) - 4):
            part = unrolled_logits(head, ids, features, 4, start)
            assert len(part) == min(4, len(ids) - 1 - start)
            for j, logits in enumerate(part):
                assert logits.shape[0] == len(ids) - 1 - j - start
                torch.testing.assert_close(logits, whole[j][start:], rtol=1e-4, atol=1e-4)
        assert len(unrolled_logits(head, ids, features, 4, len(ids) - 2)) == 1  # one position left: step 0 only


def test_soft_labels_are_the_targets_distribution_over_what_the_head_can_draft():
    """Soft cross-entropy: equal to the hard one for a one-hot target; the target's probability outside
    the draft vocabulary renormalized away; rows with nothing draftable left out."""
    from specbench.heads.train import soft_cross_entropy

    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[2, 0], [4, -100], [-100, -100]])
    one_hot = torch.tensor([[1.0, 0.0], [0.6, 0.4], [0.5, 0.5]])
    expected = torch.nn.functional.cross_entropy(logits[:2], torch.tensor([2, 4]))
    torch.testing.assert_close(soft_cross_entropy(logits, ids, one_hot), expected)
    mixed = torch.tensor([[0.3, 0.1], [0.9, 0.1], [1.0, 0.0]])
    log_q = torch.log_softmax(logits, -1)
    manual = -((0.75 * log_q[0, 2] + 0.25 * log_q[0, 0]) + log_q[1, 4]) / 2
    torch.testing.assert_close(soft_cross_entropy(logits, ids, mixed), manual)
    assert soft_cross_entropy(logits[2:], ids[2:], mixed[2:]) is None


def test_a_head_started_from_the_targets_layer_computes_that_layer_before_training(target):
    """init 'layer': at step 0 the head's output at each position is the target's stream after the layer that
    reads the high feature (the input of the next layer), whatever tokens it reads; 'output' starts elsewhere.
    Fails if a copied weight, the fc pass-through or a norm is wrong."""
    from specbench.heads.model import HeadCache
    from specbench.heads.train import _initial_head

    layer_ids = (0, 1, 2)  # high feature: layer 2's input; its output is layer 3's input
    context = PROMPTS[2]
    with torch.no_grad():
        states = target.model(torch.tensor([context]), output_hidden_states=True).hidden_states
        raw = torch.cat([states[i][0] for i in layer_ids], dim=-1)
        positions = torch.arange(len(context))
        outs = {}
        for init in ("layer", "output"):
            head = _initial_head(target, list(range(target.vocab_size)), 0, layer_ids, init)
            tokens = torch.tensor(context[1:] + [5])
            outs[init] = head(tokens, head.fuse(raw), positions, HeadCache())[0]
            other = head(torch.flip(tokens, [0]), head.fuse(raw), positions, HeadCache())[0]
            if init == "layer":
                torch.testing.assert_close(outs[init], other)  # the token half starts at zero
    torch.testing.assert_close(outs["layer"], states[3][0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(outs["output"], states[3][0], atol=1e-2)


def test_a_layer_start_is_refused_by_name_where_no_layer_reads_the_high_feature(target):
    from specbench.heads.train import TrainSpec, _initial_head

    with pytest.raises(SpecbenchError, match="final hidden state"):
        _initial_head(target, list(range(target.vocab_size)), 0, (1, 2, 4), "layer")
    with pytest.raises(SpecbenchError, match="init is one of"):
        TrainSpec(target="x", init="copy").check()


def test_train_draft_learns_what_drafting_asks_resumes_and_writes_a_loadable_head(tmp_path):
    """On a tiny random target (a chaotic function a one-layer head cannot learn in general), a head
    trained for many epochs on a few sequences of the target's own responses learns them: drafting on
    those prompts, it is accepted far more often than an untrained head. That holds only if training
    and drafting agree on what each position reads and predicts. The run resumes from its checkpoint
    (no step repeated), and the head it writes loads and drafts losslessly."""
    from specbench.heads.train import TrainSpec, held_out_acceptance, train_head

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(14))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=14, held_out=2,
                     max_new_tokens=16, draft_vocab=96, labels="greedy", ttt_steps=3, epochs=60, learning_rate=3e-3, batch=4,
                     checkpoint_every=20, eval_every=10_000)
    first = train_head(TrainSpec(**{**spec.__dict__, "epochs": 30}), tmp_path, progress=False)
    assert first.data["steps"] == first.data["total_steps"] == 90
    result = train_head(spec, tmp_path, progress=False)
    assert result.history["step"].is_monotonic_increasing and result.data["steps"] == 180
    assert result.history["loss_0"].tail(10).mean() < 0.3 * result.history["loss_0"].head(10).mean()
    target = tiny_model(seed=0, num_layers=4)
    seen = list(prompts[2:])
    untrained = held_out_acceptance(new_head(target, seed=0), target, seen, spec, max_new_tokens=16)
    learned = held_out_acceptance(load_head(tmp_path / "head", target), target, seen, spec, max_new_tokens=16)
    assert learned > untrained + 1.0, (learned, untrained)
    records = run(LocalTarget(target), seen[:3], method=["target-only", "eagle"], draft=str(tmp_path / "head"),
                  k=4, max_new_tokens=16, progress=False, warmup=False)
    got = outputs(records)
    assert all(got[("eagle", i)] == got[("target-only", i)] for i in range(3))


def test_a_feature_loss_pulls_each_row_towards_the_targets_final_state_where_its_label_came_from(tmp_path):
    """`feature_loss` (EAGLE-1's regression): after training, the head's normed state at a row that reads
    position p lies near the target's final state at p + 1 (from a fresh forward, not the cache the loss
    read), whose output the row is labelled with, and far nearer than a head trained without the loss
    does; one row off (p) stays far, so the loss meets the labels' alignment. Features cached without the
    final states are made again when the loss is asked for, and a negative weight is refused."""
    from specbench.heads.data import load_cached
    from specbench.heads.train import TrainSpec, train_head, unrolled_logits

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(10))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=10, held_out=2,
                     max_new_tokens=12, draft_vocab=96, labels="greedy", ttt_steps=2, epochs=60, learning_rate=3e-3,
                     batch=4, checkpoint_every=1_000, eval_every=10_000)
    without = train_head(spec, tmp_path, progress=False)
    assert len(load_cached(tmp_path / "features.pt", "")[0]) == 3  # no final states kept when not asked
    for name in ("checkpoint.pt",):
        (tmp_path / name).unlink()
    weighted = train_head(TrainSpec(**{**spec.__dict__, "feature_loss": 10.0}), tmp_path, progress=False)
    passes = load_cached(tmp_path / "features.pt", "")
    assert len(passes[0]) == 4  # made again, with the final states
    target = tiny_model(seed=0, num_layers=4)
    sequences = load_cached(tmp_path / "data.pt", "")["sequences"]

    def distances(head) -> tuple[float, float]:
        aligned, shifted = [], []
        with torch.no_grad():
            for (raw, *_), ids in zip(passes, sequences):
                ids = torch.tensor(ids)
                final = target.model(input_ids=ids[None], output_hidden_states=True).hidden_states[-1][0]
                states = []
                unrolled_logits(head, ids, head.fuse(raw[:-1].float()), 1, 0, states)
                aligned.append((states[0] - final[1:]).abs().mean())
                shifted.append((states[0] - final[:-1]).abs().mean())
        return float(torch.stack(aligned).mean()), float(torch.stack(shifted).mean())

    near, off = distances(weighted.head)
    plain, _ = distances(without.head)
    assert near < 0.6 * plain and near < 0.6 * off, (near, plain, off)
    with pytest.raises(SpecbenchError, match="feature_loss is a weight"):
        TrainSpec(target="x", feature_loss=-1.0).check()


def test_training_for_a_bf16_target_keeps_fp32_weights_and_leaves_the_target_in_bf16(tmp_path):
    """A bf16 target trains its head under bf16 autocast with fp32 master weights (a bf16 weight would drop
    every update under 1/256 of itself), the target's shared embeddings untouched in bf16; the loss falls,
    and the written head loads for the bf16 target in its dtype."""
    from specbench.heads.train import TrainSpec, train_head
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(10))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=10, held_out=2,
                     max_new_tokens=12, draft_vocab=96, labels="greedy", ttt_steps=2, epochs=25, learning_rate=3e-3,
                     batch=4, checkpoint_every=1_000, eval_every=10_000, dtype="bfloat16")
    result = train_head(spec, tmp_path, progress=False)
    assert result.head.fc.weight.dtype == result.head.lm_head.weight.dtype == torch.float32
    assert result.head.embed_tokens.weight.dtype == torch.bfloat16  # the target's own, shared
    assert result.history["loss_0"].tail(5).mean() < 0.5 * result.history["loss_0"].head(5).mean()
    target = load_model(ModelSpec("tiny-random:seed=0,layers=4", dtype="bfloat16"))
    assert load_head(tmp_path / "head", target).lm_head.weight.dtype == torch.bfloat16


def test_train_draft_on_tuned_kernels_loads_the_target_with_them_and_reads_the_same_features(tmp_path):
    """`kernels="tuned"` reaches the target that writes the replies and the features (its linear layers are
    tuned ones), and its features are the default kernels' to float rounding, so a head trains the same."""
    from specbench.heads.config import default_layer_ids
    from specbench.heads.data import prepare, target_pass
    from specbench.heads.train import TrainSpec, train_head
    from specbench.models.tuned_linear import TunedLinear

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(6))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=6, held_out=2,
                     max_new_tokens=8, draft_vocab=96, labels="greedy", ttt_steps=1, epochs=2, batch=2,
                     checkpoint_every=1_000, eval_every=10_000, kernels="tuned")
    tuned = prepare(spec, tmp_path / "tuned", default_layer_ids, progress=False)
    plain = prepare(TrainSpec(**{**spec.__dict__, "kernels": "default"}), tmp_path / "plain", default_layer_ids,
                    progress=False)
    assert any(isinstance(layer, TunedLinear) for layer in tuned.target.model.modules())
    assert not any(isinstance(layer, TunedLinear) for layer in plain.target.model.modules())
    layers = default_layer_ids(4)
    for ids in plain.data["sequences"]:
        ours, theirs = target_pass(tuned.target, ids, layers), target_pass(plain.target, ids, layers)
        assert torch.allclose(ours[0].float(), theirs[0].float(), atol=2e-3, rtol=1e-3)
        assert torch.allclose(ours[2].float(), theirs[2].float(), atol=2e-3)
    result = train_head(spec, tmp_path / "tuned", progress=False)
    assert result.data["steps"] == result.data["total_steps"] and result.history["loss_0"].notna().all()


def test_train_draft_reads_the_layers_asked_and_never_reuses_features_of_others(tmp_path):
    """`layers` picks the target layers the head fuses: its config keeps them (drafting taps those), a rerun in the
    same folder with other layers recomputes the cached features instead of training on the wrong ones, and a
    layer the target lacks is refused by name before any target pass."""
    from specbench.heads.train import TrainSpec, train_head

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(8))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=8, held_out=2,
                     max_new_tokens=8, draft_vocab=96, labels="greedy", ttt_steps=1, epochs=2, batch=4,
                     checkpoint_every=1_000, eval_every=10_000, layers=(0, 1, 3))
    result = train_head(spec, tmp_path / "a", progress=False)
    assert result.head.config.layer_ids == (0, 1, 3)
    data = torch.load(tmp_path / "a" / "data.pt", weights_only=False)
    assert data["feature_layers"] == [0, 1, 3]
    other = TrainSpec(**{**spec.__dict__, "layers": (1, 2, 3)})
    (tmp_path / "a" / "checkpoint.pt").unlink()  # a fresh head over the cached data, other layers
    features = torch.load(tmp_path / "a" / "features.pt", weights_only=False)[0][0]
    assert train_head(other, tmp_path / "a", progress=False).head.config.layer_ids == (1, 2, 3)
    again = torch.load(tmp_path / "a" / "features.pt", weights_only=False)[0][0]
    assert not torch.equal(features, again)  # recomputed from layers 1, 2, 3
    with pytest.raises(SpecbenchError, match=r"ids \[5\] do not exist; 4 is its final hidden state"):
        train_head(TrainSpec(**{**spec.__dict__, "layers": (0, 2, 5)}), tmp_path / "b", progress=False)


def test_sampled_responses_add_the_targets_own_text_after_the_greedy_one_and_their_cache_is_kept_apart(tmp_path):
    """`samples=3`: each training prompt gets its greedy response (the very sequences of `samples=1`) and two
    drawn at `temperature`, reproducible by seed and not all the greedy text again; data cached with other
    samples is refused by name rather than trained on."""
    from specbench.heads.data import prompt_lengths, sequences
    from specbench.heads.train import TrainSpec, train_head
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec

    target = load_model(ModelSpec("tiny-random:seed=0,layers=4"))
    prompts = [[(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(5)]
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=tuple(prompts), prompt_count=5, held_out=0,
                     max_new_tokens=10, draft_vocab=96, labels="greedy", ttt_steps=1, epochs=1, batch=2,
                     checkpoint_every=1_000, eval_every=10_000)
    greedy = sequences(target, spec, prompts, progress=False)
    drawn = TrainSpec(**{**spec.__dict__, "samples": 3, "temperature": 1.5})
    three = sequences(target, drawn, prompts, progress=False)
    assert len(three) == 15 and three[:5] == greedy
    assert all(three[5 * s + i][:len(p)] == p for s in (1, 2) for i, p in enumerate(prompts))
    assert three[5:] != greedy + greedy and three[5:10] != three[10:]
    assert sequences(target, drawn, prompts, progress=False) == three
    assert prompt_lengths(target, drawn, prompts) == [len(p) for p in prompts] * 3  # where each reply begins
    with pytest.raises(SpecbenchError, match="samples must be at least 1"):
        TrainSpec(**{**spec.__dict__, "samples": 0}).check()
    held = TrainSpec(**{**spec.__dict__, "held_out": 2})
    train_head(held, tmp_path, progress=False)
    replies = train_head(TrainSpec(**{**held.__dict__, "loss_on": "reply", "ttt_steps": 3}), tmp_path / "replies",
                         progress=False)  # labels taken from each reply's start on: every step's span lines up
    assert replies.history["loss_0"].notna().all() and (replies.history[["loss_0", "loss_2"]] > 0).all().all()
    with pytest.raises(SpecbenchError, match="loss_on"):
        TrainSpec(**{**spec.__dict__, "loss_on": "prompt"}).check()
    with pytest.raises(SpecbenchError, match=r"other \['samples'\]"):
        train_head(TrainSpec(**{**held.__dict__, "samples": 2}), tmp_path, progress=False)


def test_repeated_spans_append_a_piece_of_the_sequence_itself_and_their_data_is_kept_apart(tmp_path):
    """`repeat_spans`: the chosen share of sequences ends with one of its own spans again (from its reply or its
    prompt, a closing end-of-sequence token dropped), never past max_length; the rest are left as they were; the
    same seed gives the same data; data made without repeats is refused by name rather than trained on."""
    from specbench.heads.data import REPEAT_SPAN, with_repeats
    from specbench.heads.train import TrainSpec, train_head

    low, high = REPEAT_SPAN
    sequences = [list(range(100 * i, 100 * i + 30)) + list(range(5000 + 100 * i, 5000 + 100 * i + 70)) + [2]
                 for i in range(40)]
    lengths = [30] * 40
    made = with_repeats(sequences, lengths, 0.5, 384, {2}, seed=0)
    assert made == with_repeats(sequences, lengths, 0.5, 384, {2}, seed=0)
    kept = [m for m, s in zip(made, sequences) if m == s]
    grown = [(m, s) for m, s in zip(made, sequences) if m != s]
    assert 10 <= len(grown) <= 30 and len(kept) + len(grown) == 40
    sources = set()
    for new, old in grown:
        body, tail = new[:len(old) - 1], new[len(old) - 1:]
        assert body == old[:-1] and low <= len(tail) <= high
        start = old.index(tail[0])
        assert old[start:start + len(tail)] == tail  # a span of the sequence itself
        sources.add("prompt" if start < 30 else "reply")
    assert sources == {"prompt", "reply"}
    assert with_repeats(sequences, lengths, 1.0, 100 + low - 1, {2}, seed=0) == sequences  # no room: left as is
    assert with_repeats(sequences, lengths, 0.0, 384, {2}, seed=0) == sequences
    with pytest.raises(SpecbenchError, match="repeat_spans"):
        TrainSpec(target="x", repeat_spans=1.5).check()
    prompts = [[(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(5)]
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=tuple(prompts), prompt_count=5, held_out=2,
                     max_new_tokens=40, draft_vocab=96, labels="greedy", ttt_steps=1, epochs=1, batch=2,
                     checkpoint_every=1_000, eval_every=10_000)
    plain = train_head(spec, tmp_path, progress=False)
    repeated = TrainSpec(**{**spec.__dict__, "repeat_spans": 1.0})
    with pytest.raises(SpecbenchError, match=r"other \['repeat_spans'\]"):
        train_head(repeated, tmp_path, progress=False)
    again = train_head(repeated, tmp_path / "repeated", progress=False)
    assert again.data["tokens"] > plain.data["tokens"] and again.data["sequences"] == plain.data["sequences"]


@pytest.mark.real_model
def test_a_teacher_forced_exchange_knows_where_its_reply_begins():
    """A ShareGPT exchange trained as text: the turn's tokens are counted up to where the template opens the
    assistant's reply, so training on replies predicts the reply's tokens and not the question's."""
    from specbench.heads.data import exchange
    from specbench.models.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    messages = [{"role": "user", "content": "Name three primary colours, please. " * 30},
                {"role": "assistant", "content": "Red, yellow and blue."}]
    ids, asked = exchange(tokenizer, messages, max_length=384)
    assert asked == 96  # the question cut to its last 96 tokens
    assert tokenizer.decode(ids[asked:]).strip().startswith("Red, yellow and blue.")
    assert "assistant" in tokenizer.decode(ids[:asked])[-20:]
    short, asked_short = exchange(tokenizer, messages, max_length=50)
    assert len(short) == 50 and asked_short == 50


@pytest.mark.real_model
def test_a_head_on_smollm2_drafts_chains_and_trees_losslessly(smollm2, tmp_path):
    """SmolLM2-135M (fp32) with a head of its own shape (random weights, written in the speculators layout
    and read back, a 2,048-id draft vocabulary): greedy chains and trees equal target-only token for token,
    here and through a worker with the head on either side."""
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget
    from tests.worker_helpers import ThreadWorker

    head = new_head(smollm2, draft_ids=range(0, 4096, 2), seed=0)
    folder = save_head(head, tmp_path / "head", layout="speculators", target_name="smollm2-135m")
    prompts = ["Write a Python function that reverses a string.", "Name three primary colours."]
    records = run(LocalTarget(smollm2), prompts, method=["target-only", "eagle", "eagle-tree", "suffix-eagle-tree"],
                  draft=str(folder), k=4, max_new_tokens=16, progress=False, warmup=False)
    got = outputs(records)
    running = ThreadWorker(model=ModelSpec("smollm2-135m", dtype="float32"), draft=None, allow_load=(str(folder),))
    try:
        remote = RemoteTarget(running.endpoint, tokenizer=smollm2.tokenizer)
        got.update(outputs(run(remote, prompts, method=["eagle", "suffix-eagle", "eagle-server", "eagle-tree-server"],
                               draft=str(folder), k=4, max_new_tokens=16, progress=False, warmup=False)))
    finally:
        running.stop()
    for index in range(len(prompts)):
        for method in ("eagle", "eagle-tree", "suffix-eagle-tree", "suffix-eagle", "eagle-server", "eagle-tree-server"):
            assert got[(method, index)] == got[("target-only", index)], (method, index)


@pytest.mark.parametrize("batching", [True, False])
def test_a_head_drafts_through_a_worker_on_either_side_losslessly(tmp_path, batching):
    """Client-side (the worker sends each step's feature rows; the head, with its own copy of the
    embeddings, drafts here) and server-side (`eagle-server`: the worker drafts, only tokens travel):
    greedy output equals target-only, and the client side's bytes per step grow by a row per
    committed position."""
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget
    from tests.worker_helpers import TARGET, ThreadWorker

    model = load_model(ModelSpec(TARGET))
    head = new_head(model, seed=3)
    shared = save_head(head, tmp_path / "shared")
    own = save_head(head, tmp_path / "own", embeddings=True)
    running = ThreadWorker(allow_load=(str(shared),), batching=batching)
    try:
        remote = RemoteTarget(running.endpoint)
        with pytest.raises(SpecbenchError, match="shares its target's embeddings"):
            run(remote, PROMPTS[:1], method="eagle", draft=str(shared), k=3, max_new_tokens=4, progress=False)
        client = run(remote, PROMPTS, method=["target-only", "eagle", "eagle-tree", "suffix-eagle"], draft=str(own),
                     k=4, max_new_tokens=20, progress=False, warmup=False)
        server = run(remote, PROMPTS, method=["eagle-server", "eagle-tree-server", "suffix-eagle-server",
                                              "suffix-eagle-tree-server"], draft=str(shared), k=4,
                     max_new_tokens=20, progress=False, warmup=False)
        remote.keep_features("held", head.config.layer_ids)
        remote.prefill("held", PROMPTS[0])
        kept = (len(PROMPTS[0]) - 1) * 3 * model.model.config.hidden_size * 4  # float32 rows on the worker
        assert remote.stats()["kv_bytes"] == remote.info["kv_bytes_per_token"] * len(PROMPTS[0]) + kept
        remote.close("held")
        local = run(LocalTarget(model), PROMPTS, method=["target-only", "eagle"], draft=head, k=4, max_new_tokens=20,
                    progress=False, warmup=False)
    finally:
        running.stop()
    got, reference = {**outputs(client), **outputs(server)}, outputs(local)
    for index in range(len(PROMPTS)):
        for method in ("target-only", "eagle", "eagle-tree", "suffix-eagle", "eagle-server", "eagle-tree-server",
                       "suffix-eagle-server", "suffix-eagle-tree-server"):
            assert got[(method, index)] == reference[("target-only", index)], (method, index)
    drafted = client[client["method"] == "eagle"]
    assert (drafted["drafted"] > 0).mean() > 0.8
    plain = client.loc[client["method"] == "target-only", "bytes_down"].median()
    width = 2 * 3 * model.model.config.hidden_size  # float16 rows of three layers' inputs
    for _, step in drafted.iterrows():  # a row per committed position (the accepted path's and the old tail's)
        assert abs(step["bytes_down"] - plain - width * (step["accepted"] + 1) - 4 * step["accepted"]) < 64
    assert set(server["method"]) == {"eagle-server", "eagle-tree-server", "suffix-eagle-server",
                                     "suffix-eagle-tree-server"}
    hybrid = server[server["method"] == "suffix-eagle-server"]
    assert (hybrid["drafted"] > 0).mean() > 0.5  # drafted on the worker, by its suffix cache or its head



@pytest.mark.real_model
def test_a_served_head_drafts_for_whichever_connection_a_request_takes(smollm2, tmp_path):
    """`specbench serve` keeps free drafters for later requests, and a head reads the features its worker sends
    over the connection it was built with: its drafters are kept per connection (kept per method alone, every
    request after the first that took another connection failed: "a head drafts from the target it was attached
    to"). A head's folder is handed to its drafter, not loaded as a model. Greedy output stays target-only's."""
    import threading

    from specbench.serve.engine import Engine, Job
    from specbench.serve.settings import Limits, ServeSettings, Speculation
    from specbench.worker.launch import free_port

    head = new_head(smollm2, draft_ids=range(0, 4096, 2), seed=0)
    own = save_head(head, tmp_path / "own", embeddings=True, target_name="smollm2-135m")
    engine = Engine(ServeSettings(target="smollm2-135m", methods=("target-only", "eagle", "suffix-eagle-tree"),
                                  draft=str(own), k=4, port=free_port(), limits=Limits(max_concurrent=3)),
                    log=lambda line: None)
    try:
        def ids(method: str) -> list[int]:
            events = list(engine.stream(Job(list(PROMPTS[0]), 12, Speculation(method, 4)), threading.Event()))
            return [token for record in events[-1].records for token in record.emitted_tokens]

        expected = ids("target-only")
        for _ in range(4):  # the connections come round in turn: each drafter meets another than it was built on
            assert ids("eagle") == expected and ids("suffix-eagle-tree") == expected
    finally:
        engine.close()

def test_the_cost_model_prices_each_placements_wire_bytes():
    """Client side: a feature row per committed position comes back with each verify; server side: one
    round trip per request, the emitted tokens only, so no RTT per step."""
    from specbench.plan.predict import REPLY_BYTES, LatencyProfile, OperatingPoint, bytes_per_step, step_cost

    row = 3 * 4096 * 2  # Llama-3.1-8B's three float16 feature rows
    client = OperatingPoint("eagle", k=4, where="remote", rtt_ms=50, feature_bytes=row)
    assert bytes_per_step(client, accepted=2.5)[1] == REPLY_BYTES + 2 * 4 + row * 3.5
    assert bytes_per_step(OperatingPoint("eagle", k=4, where="remote", rtt_ms=50), accepted=2.5)[1] == REPLY_BYTES + 8
    server = OperatingPoint("eagle-server", k=4, where="remote", rtt_ms=50)
    assert bytes_per_step(server, accepted=2.5) == (0.0, 4 * 3.5)
    target = LatencyProfile("t", "cpu", rows=((1, 256, 0.05), (5, 256, 0.06)))
    draft = LatencyProfile("d", "cpu", rows=((1, 256, 0.002), (4, 256, 0.003)))
    near, far = (step_cost(OperatingPoint("eagle", k=4, where="remote", rtt_ms=rtt, feature_bytes=row), target, draft,
                           2.5, bandwidth_mbps=10) for rtt in (5, 100))
    assert far.network_s - near.network_s == pytest.approx(0.095)
    assert near.network_s > 3.5 * row * 8 / 10e6  # the rows' transfer at 10 Mbit/s is priced
    served = step_cost(server, target, draft, 2.5, bandwidth_mbps=10)
    assert served.network_s < 1e-4 and served.verify_s == near.verify_s


def test_a_head_is_profiled_recorded_and_predicted_like_any_draft(tmp_path):
    """A head gets a latency profile of its own forward and an acceptance reference of its chains and
    trees; the predictor prices `eagle` from them, and its tokens per step replay the measured run's
    (a 16-id vocabulary, so a random head is accepted now and then)."""
    from specbench.heads.profile import profile_head
    from specbench.plan.predict import OperatingPoint, predict
    from specbench.record import profile_model, record_reference

    target = tiny_model(seed=3, vocab_size=16, num_layers=4)
    head = new_head(target, seed=6)
    folder = save_head(head, tmp_path / "tiny-head")
    prompts = [[token % 16 for token in prompt] for prompt in PROMPTS]
    reference = record_reference(target, str(folder), prompts, dataset="tiny", max_chain=4, tree_budgets=(4,),
                                 max_new_tokens=16)
    assert reference.draft == "eagle:tiny-head" and reference.max_chain == 4 and 4 in reference.tree_accepts
    profile, meta = profile_head(head, reference.draft, tokens=(1, 2, 5), contexts=(16,), repeats=2)
    assert profile.model == reference.draft and [row[:2] for row in profile.rows] == [(1, 16), (2, 16), (5, 16)]
    assert all(row[2] > 0 for row in profile.rows) and profile.weight_bytes < 2 * sum(
        p.numel() * 4 for n, p in head.named_parameters() if not n.startswith("embed_tokens"))
    target_profile, _ = profile_model(target, tokens=(1, 5), contexts=(16,), repeats=2)
    rows = predict([OperatingPoint("eagle", k=4), OperatingPoint("eagle-tree", k=4)], target_profile, profile,
                   reference, context=16)
    measured = run(LocalTarget(target), prompts, method="eagle", draft=str(folder), k=4, max_new_tokens=16,
                   progress=False, warmup=False)
    full = measured[measured["drafted"] == 4]
    assert full["accepted"].sum() > 0
    assert rows[0]["tokens_per_step"] == pytest.approx(1 + full["accepted"].mean())
    assert rows[0]["tokens_per_s"] > 0 and rows[1]["tokens_per_step"] >= 1
    # remote: both placements, the client side's feature rows (3 layers' inputs, float16) in its bytes
    from specbench.plan.explore import operating_points
    from specbench.plan.library import load_references, save_reference

    assert reference.feature_bytes == 2 * head.fc.in_features == 2 * 3 * target.model.config.hidden_size
    saved = save_reference(reference, folder=tmp_path / "references")
    assert load_references(saved.parent)[0].feature_bytes == reference.feature_bytes
    points = operating_points(reference, (4,), rtts_ms=(100.0,), remote=True, local=False)
    by_label = {point.label: point for point in points}
    assert sorted(by_label) == ["eagle K=4 (remote 100ms)", "eagle-server K=4 (remote 100ms)",
                                "eagle-tree budget=4 (remote 100ms)", "eagle-tree-server budget=4 (remote 100ms)",
                                "target-only (remote 100ms)"]
    assert by_label["eagle K=4 (remote 100ms)"].feature_bytes == reference.feature_bytes
    assert by_label["eagle-server K=4 (remote 100ms)"].feature_bytes == 0
    priced = {row["label"]: row for row in predict(points, target_profile, profile, reference, context=16)}
    client, server = priced["eagle K=4 (remote 100ms)"], priced["eagle-server K=4 (remote 100ms)"]
    assert client["tokens_per_step"] == server["tokens_per_step"]
    assert client["bytes_per_token"] > server["bytes_per_token"] + reference.feature_bytes  # a row per position
    assert server["tokens_per_s"] > client["tokens_per_s"]  # no round trip per step on the worker's side
    assert all(p.method in ("target-only", "eagle", "eagle-tree") for p in operating_points(
        reference, (4,), rtts_ms=(100.0,), remote=True, local=False, worker_side=False))


@pytest.mark.parametrize("option, flag", [({"ttt_steps": 5}, "--ttt-steps"), ({"init": "layer"}, "--init"),
                                          ({"draft_vocab": 100, "layout": "speculators"}, "--draft-vocab, --layout"),
                                          ({"layers": (1, 2, 3)}, "--layers"), ({"own_embeddings": True},
                                                                                "--own-embeddings"),
                                          ({"feature_loss": 1.0}, "--feature-loss")])
def test_distil_refuses_the_options_of_a_head_by_name(tmp_path, option, flag):
    """`--distil` with a head's option (which it would not use) is refused before any model loads, naming it."""
    from specbench.heads.distil import distil_draft
    from specbench.heads.train import TrainSpec

    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=((3, 4, 5), (6, 7), (8, 9)), prompt_count=3,
                     held_out=1, **option)
    with pytest.raises(SpecbenchError, match=flag + " shape"):
        distil_draft(spec, 2, tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # refused before any data was made


def test_distil_loss_reads_the_labels_option():
    """greedy: cross-entropy on the target's argmax (the first top id); soft: on its renormalized top probabilities;
    the two agree when the target's top probability is 1."""
    from specbench.heads.distil import _distil_loss

    logits = torch.randn(5, 11)
    choices = torch.stack([torch.randperm(11)[:3] for _ in range(5)])
    probs = torch.tensor([[0.6, 0.3, 0.1]] * 5)
    greedy = _distil_loss(logits, choices, probs, "greedy")
    assert torch.allclose(greedy, torch.nn.functional.cross_entropy(logits, choices[:, 0]))
    soft = _distil_loss(logits, choices, probs, "soft")
    log_q = torch.log_softmax(logits, -1).gather(-1, choices)
    assert torch.allclose(soft, -(probs * log_q).sum(-1).mean())
    certain = torch.tensor([[1.0, 0.0, 0.0]] * 5)
    assert torch.allclose(_distil_loss(logits, choices, certain, "soft"), greedy)


def test_distil_trains_on_replies_only_with_greedy_labels(tmp_path, monkeypatch):
    """`loss_on="reply"` with `labels="greedy"`: the loss reads only the rows that predict the reply (at most
    the prompt's last position and the reply's 16), with greedy labels, and still falls."""
    from specbench.heads import distil
    from specbench.heads.distil import distil_draft
    from specbench.heads.train import TrainSpec

    seen = []
    loss = distil._distil_loss
    monkeypatch.setattr(distil, "_distil_loss", lambda logits, choices, probs, labels: (
        seen.append((logits.shape[0], labels)), loss(logits, choices, probs, labels))[1])

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(10))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=10, held_out=2,
                     max_new_tokens=16, epochs=20, learning_rate=3e-3, batch=4, eval_every=10_000,
                     loss_on="reply", labels="greedy")
    result = distil_draft(spec, 2, tmp_path, progress=False)
    assert result.history["loss_0"].tail(5).mean() < 0.7 * result.history["loss_0"].head(5).mean()
    assert seen and all(rows <= 17 and labels == "greedy" for rows, labels in seen)  # all positions: 22 or more


def test_distilling_the_targets_first_layers_gives_a_draft_that_is_accepted_more(tmp_path):
    """`train-draft --distil 2` on a 4-layer tiny target: the draft (the target's first two layers, its norm
    and output layer, trained on the target's distributions) is accepted more on the prompts it saw than
    the same layers untrained (self-draft), and is written as a model folder that loads and drafts
    losslessly."""
    from transformers import AutoModelForCausalLM

    from specbench.decode.metrics import tokens_per_step
    from specbench.heads.distil import distil_draft
    from specbench.heads.train import TrainSpec
    from specbench.models.loaded import LoadedModel
    from specbench.models.self_draft import truncated_view

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(10))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=10, held_out=2,
                     max_new_tokens=16, epochs=40, learning_rate=3e-3, batch=4, eval_every=10_000)
    result = distil_draft(spec, 2, tmp_path, progress=False)
    assert result.history["loss_0"].tail(5).mean() < 0.85 * result.history["loss_0"].head(5).mean()  # soft: entropy floor
    target = tiny_model(seed=0, num_layers=4)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    assert model.config.num_hidden_layers == 2
    distilled = LoadedModel(spec=target.spec.with_(model=str(tmp_path / "draft")), model=model.eval(), tokenizer=None)
    seen = list(prompts[2:])
    records = run(LocalTarget(target), seen, method=["target-only", "chain"], draft=distilled, k=4, max_new_tokens=16,
                  progress=False, warmup=False)
    plain = run(LocalTarget(target), seen, method="self-draft", self_draft_layers=2, k=4, max_new_tokens=16,
                progress=False, warmup=False)
    got = outputs(records)
    assert all(got[("chain", i)] == got[("target-only", i)] for i in range(len(seen)))
    assert tokens_per_step(records[records["method"] == "chain"]) > tokens_per_step(plain) + 0.3
    trained = dict(result.head.named_parameters())
    original = truncated_view(target, 2).model.state_dict()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])


def test_a_damaged_training_folder_is_named_and_what_can_be_made_again_is(tmp_path, capsys):
    """An outside tester's truncated files in a train-draft folder: before, each raised the reader's own
    error (miniz's "failed finding central directory", OSError 22, safetensors' header error) with no file
    named. Now the responses (data.pt) and the optimizer state (checkpoint.pt) are refused naming the file
    and what to delete; the features, made from data.pt alone, are made again; and every file is written
    whole (beside its name, then renamed), so a kill mid-write cannot make such a file."""
    import shutil

    from specbench.heads.train import TrainSpec, train_head

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6 + i % 5)] for i in range(8))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=8, held_out=2,
                     max_new_tokens=8, draft_vocab=96, labels="greedy", ttt_steps=2, epochs=2, batch=4,
                     checkpoint_every=2, eval_every=10_000)
    train_head(spec, tmp_path / "whole", progress=False)
    assert not list((tmp_path / "whole").rglob("*.tmp"))
    more = TrainSpec(**{**spec.__dict__, "epochs": 3})
    for name, words in (("data.pt", "data.pt does not load.*delete this folder's data.pt"),
                        ("checkpoint.pt", "checkpoint.pt does not load.*delete it and head/"),
                        ("head/model.safetensors", "head's weights at .*model.safetensors"),
                        ("features.pt", None)):
        folder = tmp_path / name.replace("/", "-")
        shutil.copytree(tmp_path / "whole", folder)
        damaged = folder / name
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
        if words:
            with pytest.raises(SpecbenchError, match=words):
                train_head(more, folder, progress=False)
        else:
            capsys.readouterr()
            result = train_head(more, folder, progress=False)
            assert result.data["steps"] == result.data["total_steps"] == 4
            assert "features.pt does not load" in capsys.readouterr().err
            assert torch.load(damaged, weights_only=False)  # made again, whole


@pytest.mark.parametrize("changes,words", [
    ({"learning_rate": -1.0}, "learning_rate must be positive"),
    ({"minutes": -1.0}, "minutes must be positive"),
    ({"max_length": 3}, "max_length 3 must hold"),
    ({"max_length": 96, "max_new_tokens": 96}, "max_length 96 must hold"),
])
def test_training_settings_that_cannot_train_are_refused_by_name(changes, words):
    """An outside tester's settings: before, a negative learning rate trained (gradient ascent), a negative
    time bound and a max_length shorter than the response ran on unsaid."""
    from specbench.heads.train import TrainSpec

    with pytest.raises(SpecbenchError, match=words):
        TrainSpec(target="x", **changes).check()
    TrainSpec(target="x", max_length=96, max_new_tokens=96, teacher_forced=True).check()  # no response to hold


def test_layers_the_target_lacks_are_refused_before_any_response_is_made(tmp_path, monkeypatch):
    """`--layers 1 2 99` on a 30-layer target was refused only after the target's replies (minutes)."""
    import specbench.heads.data as data
    from specbench.heads.train import TrainSpec, train_head

    def no_replies(*args, **kwargs):
        raise AssertionError("replies made before the layers were checked")

    monkeypatch.setattr(data, "sequences", no_replies)
    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6)] for i in range(6))
    with pytest.raises(SpecbenchError, match=r"layers \[0, 2, 9\].*ids \[9\] do not exist"):
        train_head(TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=6, held_out=2,
                             layers=(0, 2, 9)), tmp_path, progress=False)


def test_two_heads_of_one_worker_hybrid_keep_their_caches_apart(tmp_path):
    """"suffix-eagle-server:4@A" beside "...@B" in one call: the worker keeps a suffix cache for each (a shared
    one would hand B, on each prompt, A's output of that very prompt), so B drafts step for step as it does alone;
    both outputs are target-only's."""
    from specbench.decode.suffix_drafter import SuffixSettings
    from specbench.models.loading import load_model
    from specbench.models.spec import ModelSpec
    from specbench.worker.client import RemoteTarget
    from tests.worker_helpers import TARGET, ThreadWorker

    model = load_model(ModelSpec(TARGET))
    first = str(save_head(new_head(model, seed=3), tmp_path / "first"))
    second = str(save_head(new_head(model, seed=4), tmp_path / "second"))
    running = ThreadWorker(allow_load=(first, second))
    try:
        remote = RemoteTarget(running.endpoint)
        settings = dict(k=4, max_new_tokens=16, progress=False, warmup=False)
        both = run(remote, PROMPTS, method=[f"suffix-eagle-server:4@{first}", f"suffix-eagle-server:4@{second}"],
                   **settings)
        alone = run(remote, PROMPTS, method="suffix-eagle-server", draft=second, suffix=SuffixSettings(cache="drafter"),
                    **settings)
    finally:
        running.stop()
    local = outputs(run(LocalTarget(model), PROMPTS, method="target-only", **settings))
    mine = both[both["method"] == f"suffix-eagle-server@{second}"]
    assert mine.groupby("prompt_index")["drafted"].apply(list).tolist() == \
        alone.groupby("prompt_index")["drafted"].apply(list).tolist()
    produced = outputs(both)
    for label in (f"suffix-eagle-server@{first}", f"suffix-eagle-server@{second}"):
        assert [produced[(label, i)] for i in range(len(PROMPTS))] == \
            [local[("target-only", i)] for i in range(len(PROMPTS))]


def test_the_router_chooses_between_heads_each_drafting_with_its_own(target, tmp_path):
    """Heads as a router's candidates ("eagle-tree:4@CODE" beside "suffix-eagle-tree:4@CHAT", a head trained per
    family): calibration runs each head from its own folder, the router keeps them apart, and `auto` drafts a
    prompt with the chosen candidate's head, step for step as that candidate alone does; outputs are target-only's."""
    from specbench.route.auto import candidates_from, train_router

    first = str(save_head(new_head(target, seed=3), tmp_path / "first"))
    second = str(save_head(new_head(target, seed=4), tmp_path / "second"))
    specs = ["target-only", f"eagle-tree:4@{first}", f"suffix-eagle-tree:4@{second}"]
    local = LocalTarget(target)
    settings = dict(max_new_tokens=16, progress=False, warmup=False)
    router, records = train_router(local, PROMPTS, candidates_from(specs), **settings)
    assert set(records["method"]) == {"target-only", f"eagle-tree@{first}", f"suffix-eagle-tree@{second}"}
    calibrated = records[records["method"] != "target-only"].groupby("method")["drafted"].apply(list)
    assert calibrated[f"eagle-tree@{first}"] != calibrated[f"suffix-eagle-tree@{second}"]  # each its own head
    for chosen in specs[1:]:
        router.margin, router.by_family = float("inf"), False  # always the default: this candidate
        router.default = next(c.label for c in router.candidates if c.spec == chosen)
        got = run(local, PROMPTS, method=["target-only", "auto", chosen], router=router, k=4, **settings)
        label = chosen.replace(":4", "")
        routed, alone = (got[got["method"] == name].groupby("prompt_index")["drafted"].apply(list)
                         for name in ("auto", label))
        assert routed.tolist() == alone.tolist()
        produced = outputs(got)
        for index in range(len(PROMPTS)):
            assert produced[("auto", index)] == produced[(label, index)] == produced[("target-only", index)]
        assert set(got.loc[got["method"] == "auto", "chosen"]) == {router.default}


def test_train_draft_says_so_when_its_minutes_end_before_a_first_step(tmp_path):
    """`--minutes` spent on the target's replies and features (a long prompt set on a slow box): the command
    crashed on an empty loss history after the minutes of work it had cached; it now says no step was taken and
    that a rerun trains from the cache, which it does."""
    from specbench.heads.command import _final_loss
    from specbench.heads.train import TrainSpec, train_head

    prompts = tuple([(i * 11 + j * 7) % 90 + 3 for j in range(6)] for i in range(6))
    spec = TrainSpec(target="tiny-random:seed=0,layers=4", prompts=prompts, prompt_count=6, held_out=2,
                     max_new_tokens=4, epochs=2, batch=2, eval_every=10_000)
    cut = train_head(TrainSpec(**{**spec.__dict__, "minutes": 1e-9}), tmp_path, progress=False)
    assert cut.data["steps"] == 0 and cut.history.empty
    assert "no training step within --minutes" in _final_loss(cut) and "untrained" in _final_loss(cut)
    done = train_head(spec, tmp_path, progress=False)
    assert done.data["steps"] == done.data["total_steps"] == 4
    assert _final_loss(done) == f", final loss {done.history['loss_0'].iloc[-1]:.3f}"
