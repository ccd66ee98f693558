"""Tuned linear layers (`kernels="tuned"`): every product form gives the plain layer's output to float
rounding, the choice keeps PyTorch's unless another is clearly faster, SD through them stays lossless,
and loads where they cannot run are refused by name."""
import copy
import json

import pytest
import torch
from torch import nn

from specbench.decode.drafters import ModelDrafter
from specbench.decode.loop import Decoding, generate
from specbench.decode.target import LocalTarget
from specbench.models.loaded import LoadedModel
from specbench.models.spec import ModelSpec, acceptance_label
from specbench.models.tuned_linear import ROWS, TunedLinear, choose, measure, use_tuned
from specbench.types import SpecbenchError

from conftest import PROMPTS, assert_batches_match_lone_verifies

FORMS = ("linear", "transposed", "pretransposed", "onednn")  # and "padded", for one row only


def _forced(model: nn.Module) -> int:
    """Every linear layer as a TunedLinear that uses a different form at each row count (all five
    forms, whatever the layer's size), so one forward mixes them all; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                choices = {rows: FORMS[(rows + replaced) % len(FORMS)] for rows in ROWS}
                if replaced % 2:
                    choices[1] = "padded"
                setattr(parent, name, TunedLinear(child, choices))
                replaced += 1
    return replaced


@pytest.fixture(scope="module")
def forced_target(tiny_target):
    model = copy.deepcopy(tiny_target.model)
    assert _forced(model) > 0
    return LoadedModel(spec=tiny_target.spec.with_(kernels="tuned"), model=model, tokenizer=None)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_form_is_the_plain_product(form, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    tuned = TunedLinear(linear, {rows: form for rows in ROWS})
    for rows in (1, 2, 5, 16, 17, 65):  # 65: past the measured counts, PyTorch's own
        x = torch.randn(2, rows, 48)
        with torch.inference_mode():
            torch.testing.assert_close(tuned(x), linear(x), rtol=1e-5, atol=1e-5)
    assert tuned.weight is linear.weight  # the same tensor, no copy for the plain forms
    assert (tuned.weight_t is not None) == (form == "pretransposed")
    assert (tuned.onednn is not None) == (form == "onednn")


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_padded_to_two_is_the_plain_product(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    tuned = TunedLinear(linear, {1: "padded", 2: "transposed"})
    for shape in ((1, 48), (1, 1, 48), (2, 48)):
        x = torch.randn(*shape)
        with torch.inference_mode():
            got = tuned(x)
            torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        assert got.shape == (*shape[:-1], 80) and got.is_contiguous()
    assert tuned.by_rows[0] == "linear"  # an empty input never takes the one-row form


def test_fewer_rows_take_the_next_measured_count_and_more_keep_pytorch():
    tuned = TunedLinear(nn.Linear(8, 8), {1: "linear", 8: "transposed", 12: "pretransposed", 16: "linear"})
    assert tuned.by_rows[2] == tuned.by_rows[8] == "transposed" and tuned.by_rows[9] == "pretransposed"
    assert tuned.by_rows[16] == "linear" and len(tuned.by_rows) == max(ROWS) + 1


def test_a_form_replaces_pytorch_only_when_clearly_faster():
    times = {1: {"linear": 1.0, "transposed": 0.95}, 2: {"linear": 1.0, "transposed": 0.5},
             4: {"linear": 0.9, "transposed": 1.0}}
    assert choose(times) == {1: "linear", 2: "transposed", 4: "linear"}


def test_a_layer_keeps_at_most_one_copy_the_one_that_saves_most():
    """A head where a transposed copy wins one row count and a oneDNN copy two: keeping both would hold the
    weight three times, so the oneDNN copy (more time saved in all) stays, and 1 row falls back."""
    times = {1: {"linear": 1.0, "transposed": 1.0, "pretransposed": 0.5, "onednn": 0.95},
             2: {"linear": 2.0, "transposed": 1.5, "pretransposed": 1.9, "onednn": 1.0},
             3: {"linear": 2.0, "transposed": 1.5, "pretransposed": 1.9, "onednn": 1.0}}
    assert choose(times) == {1: "linear", 2: "onednn", 3: "onednn"}
    times[1]["pretransposed"] = 0.1  # now the transposed copy saves more: 0.9 at 1 row against 2 x 0.1
    times[2]["onednn"] = times[3]["onednn"] = 1.4
    assert choose(times) == {1: "pretransposed", 2: "transposed", 3: "transposed"}


def test_measure_times_every_form_a_layer_can_take():
    layer = nn.Linear(16, 24)
    found = measure([layer], rows=(1, 3), repeats=1)
    assert set(found[1]) == {"linear", "transposed", "padded"} and set(found[3]) == {"linear", "transposed"}
    found = measure([layer], rows=(2,), repeats=1, copies=True)  # a head's
    assert set(found[2]) >= {"linear", "transposed", "pretransposed"} and min(found[2].values()) > 0


def test_tuned_layers_give_the_same_logits(tiny_target, forced_target):
    with torch.inference_mode():
        for length in (1, 2, 3, 5, 8, 13):
            ids = torch.tensor([PROMPTS[0][:length]])
            want, got = tiny_target.model(input_ids=ids).logits, forced_target.model(input_ids=ids).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_sd_through_tuned_layers_is_lossless(tiny_draft, forced_target):
    """Golden: greedy chain SD on the tuned target equals its own target-only greedy, token for token,
    alone (verifies of 2-5 rows, each through other forms than the 1-row steps) and in a packed batch."""
    for prompt in PROMPTS[:3]:
        alone = generate(LocalTarget(forced_target), None, prompt, Decoding(0, 24, kind="none")).output_ids
        for k in (1, 2, 4):
            sd = generate(LocalTarget(forced_target), ModelDrafter(tiny_draft, 96), prompt,
                          Decoding(k, 24, kind="chain")).output_ids
            assert sd == alone
    batched, lone = LocalTarget(forced_target), LocalTarget(forced_target, kv_pool=False)
    assert batched.packed
    assert_batches_match_lone_verifies(batched, lone, PROMPTS[:3], [ModelDrafter(tiny_draft, 96)] * 3, steps=6,
                                       k=(1, 2, 3))


def test_smollm2_tuned_keeps_its_tied_head_and_counts_any_copy(smollm2):
    """Every linear layer is tuned, measured per shape; the head stays tied to the embedding unless a copy
    was chosen, and then the copy is counted; logits match the plain model's at verify sizes."""
    model = copy.deepcopy(smollm2.model)
    table = use_tuned(model, sample=2, rows=(1, 2, 5), repeats=1, store=False)
    assert sorted(table) == sorted({(m.out_features, m.in_features, m.bias is not None)
                                    + (("head",) if m is smollm2.model.lm_head else ())
                                    for m in smollm2.model.modules() if type(m) is nn.Linear})
    assert all(set(choices) == {1, 2, 5} and set(choices.values()) <= {*FORMS, "padded"}
               and "padded" not in (choices[2], choices[5]) for choices in table.values())
    assert not any(type(m) is nn.Linear for m in model.modules())
    head = model.lm_head
    assert head.weight is model.model.embed_tokens.weight
    tuned = LoadedModel(spec=smollm2.spec.with_(kernels="tuned"), model=model, tokenizer=smollm2.tokenizer)
    copies = (head.weight_t is not None) + (head.onednn is not None)
    assert copies <= 1 and all(m.weight_t is None and m.onednn is None for m in model.modules()
                               if isinstance(m, TunedLinear) and m is not head)
    assert tuned.weight_bytes == smollm2.weight_bytes + copies * 576 * 49152 * 4
    assert tuned.spec.label == "smollm2-135m+tuned" and acceptance_label(tuned.spec.label) == "smollm2-135m"
    ids = torch.tensor([PROMPTS[0]]) % 1000 + 100
    with torch.inference_mode():
        plain = smollm2.model(input_ids=ids, use_cache=True)
        mine = model(input_ids=ids, use_cache=True)
        for new in (1, 2, 5):
            step = torch.tensor([[300 + i for i in range(new)]])
            want = smollm2.model(input_ids=step, past_key_values=plain.past_key_values).logits
            got = model(input_ids=step, past_key_values=mine.past_key_values).logits
            plain.past_key_values.crop(-new)
            mine.past_key_values.crop(-new)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("changes, words", [
    ({"dtype": "float16"}, "float32 or bfloat16"), ({"quantization": "int8-dynamic"}, "unquantized"),
    ({"device": "cuda"}, "CPU")])
def test_tuned_where_it_cannot_run_is_refused_by_name(changes, words):
    from specbench.models.loading import load_model

    with pytest.raises(SpecbenchError, match=words):
        load_model(ModelSpec("tiny-random:seed=0,vocab=96,hidden=64,layers=3", **{"kernels": "tuned", **changes}))


def test_choices_are_measured_once_per_machine_and_a_bad_store_is_measured_again(tmp_path, monkeypatch, capsys):
    """The first load measures and stores; the next reads the store (same forms, no measuring); a store that is
    not JSON is named, measured again and rewritten; a row count the store lacks is measured."""
    import specbench.models.tuned_linear as tuned_linear
    from specbench.models.tiny import tiny_model

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    first = use_tuned(tiny_model(seed=0).model, rows=(1, 2), repeats=1)
    path = tuned_linear.store_path()
    assert path.exists() and path.parent == tmp_path / "kernels"

    def refuse(*args, **kwargs):
        raise AssertionError("measured although stored")

    with monkeypatch.context() as patched:
        patched.setattr(tuned_linear, "measure", refuse)
        assert use_tuned(tiny_model(seed=0).model, rows=(1, 2)) == first
    path.write_text("{not json")
    assert use_tuned(tiny_model(seed=0).model, rows=(1, 2), repeats=1)
    assert "unreadable" in capsys.readouterr().err and json.loads(path.read_text())
    wider = use_tuned(tiny_model(seed=0).model, rows=(1, 2, 3), repeats=1)
    assert all(set(choices) == {1, 2, 3} for choices in wider.values())


def test_a_tiny_model_loads_tuned():
    from specbench.models.loading import load_model

    loaded = load_model(ModelSpec("tiny-random:seed=0,vocab=96,hidden=64,layers=3", kernels="tuned"))
    assert loaded.model.tuned_kernels and any(isinstance(m, TunedLinear) for m in loaded.model.modules())


@pytest.mark.parametrize("bad", [{"1": "evil"}, {"x": "linear"}, "linear", {"1": 3}, {"0": "linear"},
                                 {"2": "padded"}, {"1": "onednn"}])
def test_a_stored_entry_that_is_not_row_counts_to_forms_is_named_and_measured_again(bad, tmp_path, monkeypatch,
                                                                                     capsys):
    """An outside tester's edited store: an unknown form, a row count that is no count, an entry that is
    no map, padding past one row, a weight copy for a layer that is not the head. Before, the first two
    loaded as PyTorch's form unsaid and the others raised ValueError / AttributeError from `int` and `.items`."""
    import specbench.models.tuned_linear as tuned_linear
    from specbench.models.tiny import tiny_model

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    first = use_tuned(tiny_model(seed=0).model, rows=(1, 2), repeats=1)
    path = tuned_linear.store_path()
    stored = json.loads(path.read_text())
    entry = next(name for name in stored if "head" not in name)
    path.write_text(json.dumps(dict(stored, **{entry: bad})))
    capsys.readouterr()
    again = use_tuned(tiny_model(seed=0).model, rows=(1, 2), repeats=1)
    assert entry in capsys.readouterr().err and set(again) == set(first)
    assert all(set(choices) == {1, 2} for choices in again.values())
    assert tuned_linear._known(json.loads(path.read_text())[entry], copies=False, why="")  # rewritten, well formed
