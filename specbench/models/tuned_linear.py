"""Linear layers that take, per number of rows, the fastest of equal products on this CPU (`kernels="tuned"`).

Why: PyTorch's CPU `linear` is poor at the 2-8 rows a verify feeds on some CPUs. On the 2-vCPU AMD EPYC
(AVX2) box SmolLM2's head, [2, 576] x [576, 49152], took 31 ms against 15 ms for one row, while the same
product written as W @ x^T took 9.7 ms; its MLP layers gained 1.5-2.5x the same way at 2-5 rows. Which form
wins depends on the CPU, the layer's shape and the row count, so it is measured once at load on the model's
own weights, per shape and row count, and the fastest kept: PyTorch's own unless another takes under
`MARGIN` of its time (the others round differently, so none is taken for noise). Row counts past the
largest measured (prompts) keep PyTorch's. The choice is stored per CPU (its name, threads and instruction
sets), PyTorch version and dtype in the user cache (`kernels/`), so a model measures once per machine (Qwen2.5
0.5B's 33 s) and every later load of that shape takes the same forms, rounds the same and loads at once.

Forms: "linear" (PyTorch's), "transposed" (W @ x^T on the same weights, its output made contiguous: what
follows reads rows), "padded" (one row computed as two: the same CPU's 2-column product beat its 1-row one, 9.7
against 15 ms for that head, so a target-only step gains too), and for the language-model head alone
"pretransposed" (x @ W^T from a transposed copy) and "onednn" (`cpu_kernels.OneDNNLinear`, float32). A copy
costs the layer's bytes again, so the head keeps at most one, only where chosen, and `weight_bytes` counts it;
the other layers take only the forms that share the weight (a copy of each of Qwen 0.5B's MLP layers, which
oneDNN won at one row, added half the model for 1.2x at that one shape).
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from specbench.files import write_text
from specbench.models.cpu_kernels import OneDNNLinear, check_plain_cpu_layers
from specbench.types import SpecbenchError

# the row counts measured (a verify of 1-8 tokens, trees, a worker's batches); fewer rows take the next one's choice
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
MARGIN = 0.9
COPIES = ("pretransposed", "onednn")  # the forms that hold a copy of the weight


def check_tuned(device: str, dtype: str, quantization: str) -> None:
    """Refuse, naming why, a load that asks for tuned kernels where they cannot run."""
    check_plain_cpu_layers("tuned", device, quantization)
    if dtype not in ("float32", "bfloat16"):
        raise SpecbenchError(f"kernels='tuned' is for float32 or bfloat16 CPU layers, not {dtype!r}")


class TunedLinear(nn.Module):
    """An `nn.Linear` (same weight and bias tensors) whose product form is chosen by the input's row count."""

    def __init__(self, linear: nn.Linear, choices: dict, forms: Optional[list] = None):
        """`forms`: the forms to make copies for (default: those chosen), e.g. every form while measuring."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.choices = dict(choices)  # rows -> form, for the measured row counts
        self.by_rows = [_choice_for(rows, self.choices) for rows in range(max(ROWS) + 1)]
        forms = set(self.choices.values() if forms is None else forms)
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous() if "pretransposed" in forms
                             else None)
        self.onednn = OneDNNLinear(linear) if "onednn" in forms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        rows = x.numel() // self.in_features
        form = self.by_rows[rows] if rows < len(self.by_rows) else "linear"
        if form == "linear":
            return nn.functional.linear(x, self.weight, self.bias)
        return product(form, self, x.reshape(rows, self.in_features)).reshape(*x.shape[:-1], self.out_features)


def _choice_for(rows: int, choices: dict) -> str:
    if rows == 0:
        return "linear"
    larger = [count for count in sorted(choices) if count >= rows]
    return choices[larger[0]] if larger else "linear"


def product(form: str, layer, rows: torch.Tensor) -> torch.Tensor:
    """`rows` [n, in] times `layer`'s weight, plus its bias, in `form`; [n, out]."""
    weight, bias = layer.weight, layer.bias
    if form == "transposed":
        out = (weight @ rows.T).T.contiguous()
        return out if bias is None else out + bias
    if form == "padded":  # rows is [1, in]
        out = (weight @ torch.cat([rows, rows]).T)[:, :1].T.contiguous()
        return out if bias is None else out + bias
    if form == "pretransposed":
        return rows @ layer.weight_t if bias is None else torch.addmm(bias, rows, layer.weight_t)
    if form == "onednn":
        return layer.onednn(rows)
    return nn.functional.linear(rows, weight, bias)


def _forms(linear: nn.Linear, rows: int, copies: bool) -> list[str]:
    forms = ["linear", "transposed"] + (["padded"] if rows == 1 else [])
    if copies:
        forms.append("pretransposed")
        if linear.weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            forms.append("onednn")
    return forms


@torch.inference_mode()
def measure(layers: list, rows: tuple = ROWS, repeats: int = 3, copies: bool = False) -> dict:
    """{rows: {form: seconds}} for one product through each of `layers` (same shape), the forms
    interleaved repeat by repeat so drift hits them alike; the median of `repeats`. `copies`: the forms
    that copy the weight too (a head's)."""
    first = layers[0]
    timed = [TunedLinear(layer, {}, _forms(first, 1, copies)) for layer in layers]
    found: dict = {}
    for count in rows:
        forms = _forms(first, count, copies)
        x = torch.randn(count, first.in_features, dtype=first.weight.dtype)
        samples: dict = {form: [] for form in forms}
        for form in forms:  # warm each form up once
            for layer in timed:
                product(form, layer, x)
        for _ in range(repeats):
            for form in forms:
                started = time.perf_counter()
                for layer in timed:
                    product(form, layer, x)
                samples[form].append(time.perf_counter() - started)
        found[count] = {form: statistics.median(values) for form, values in samples.items()}
    return found


def choose(times: dict) -> dict:
    """{rows: form}: per row count the fastest form, PyTorch's unless another takes under `MARGIN` of its time;
    of the forms that copy the weight at most one, the one that saves the most time summed over row counts."""
    def fastest(allowed) -> dict:
        chosen = {}
        for count, by_form in times.items():
            best = min((form for form in by_form if form in allowed), key=by_form.get)
            chosen[count] = best if by_form[best] < MARGIN * by_form["linear"] else "linear"
        return chosen

    plain = sorted({form for by_form in times.values() for form in by_form} - set(COPIES))
    options = [fastest(plain + [copy]) for copy in COPIES] + [fastest(plain)]
    return min(options, key=lambda chosen: sum(times[count][form] for count, form in chosen.items()))


def store_path() -> Path:
    """This machine's stored choices: one file per CPU, thread count and PyTorch version."""
    from specbench.data_paths import cache_root
    from specbench.hardware import device_name

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{device_name('cpu')}-torch{torch.__version__}")
    return cache_root() / "kernels" / f"{name}.json"


def _stored(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
        return entries
    except (OSError, ValueError) as error:
        print(f"specbench: the stored kernel choices {path} are unreadable ({error}); measuring again and "
              f"rewriting them", file=sys.stderr)
        return {}


def _known(entry, copies: bool, why: str) -> dict:
    """{rows: form} from a stored entry; one that is not such a map of this module's forms (a file edited
    or written by another version) is said and measured again, never taken as PyTorch's form unsaid."""
    forms = {"linear", "transposed", "padded"} | (set(COPIES) if copies else set())
    if isinstance(entry, dict) and all(isinstance(count, str) and count.isdigit() and int(count) > 0
                                       and form in forms and (form != "padded" or count == "1")
                                       for count, form in entry.items()):
        return {int(count): form for count, form in entry.items()}
    print(f"specbench: {why} is not a map of row counts to product forms {sorted(forms)}; measuring again and "
          f"rewriting it", file=sys.stderr)
    return {}


def _entry(key: tuple, dtype: torch.dtype) -> str:
    return "x".join(str(part) for part in key) + f"-{str(dtype).removeprefix('torch.')}"


def use_tuned(model: nn.Module, sample: int = 3, rows: tuple = ROWS, repeats: int = 3, store: bool = True) -> dict:
    """Replace, in place, every plain `nn.Linear` by a `TunedLinear` whose forms were measured on up to
    `sample` layers of its shape (or read from this machine's store, when it has every row count asked for);
    returns {(out, in, bias[, "head"]): {rows: form}}, what was chosen."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    groups: dict = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                key = (child.out_features, child.in_features, child.bias is not None) + (("head",) if child is head
                                                                                         else ())
                groups.setdefault(key, []).append((parent, name, child))
    path = store_path() if store else None
    stored = _stored(path) if path else {}
    table, measured = {}, False
    for key, members in groups.items():
        entry = _entry(key, members[0][2].weight.dtype)
        known = _known(stored.get(entry, {}), copies=key[-1] == "head", why=f"{path}'s entry {entry}")
        if set(rows) <= set(known):
            table[key] = {count: known[count] for count in rows}
        else:
            table[key] = choose(measure([child for _, _, child in members[:sample]], rows, repeats,
                                        copies=key[-1] == "head"))
            stored[entry], measured = {str(count): form for count, form in table[key].items()}, True
        for parent, name, child in members:
            setattr(parent, name, TunedLinear(child, table[key]))
    if path and measured:
        write_text(path, json.dumps(stored, indent=1, sort_keys=True))  # loads in several processes may store at once
    model.tuned_kernels = table  # what was chosen, for records and the docs
    return table
