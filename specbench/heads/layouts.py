"""Draft heads on disk, in the two layouts published heads come in, read and written here.

- `eagle3`: EAGLE-3's own checkpoints as vLLM and SGLang read them: a Llama-style `config.json`
  (`LlamaForCausalLMEagle3`, `draft_vocab_size`, `target_hidden_size`, `eagle_config` with the layer
  ids) and weights `fc.*`, `midlayer.*`, `norm.*`, `lm_head.*`, `d2t`, `t2d` (embeddings optional).
- `speculators`: vLLM's speculators format: `speculators_model_type: eagle3`, the decoder layer's
  settings under `transformer_layer_config`, weights under `layers.0.*`, its own `embed_tokens`.

A head that does not fit the target (hidden size, vocabulary, layers it reads) is refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from specbench.files import replacing, write_text
from specbench.heads.config import HeadConfig
from specbench.heads.features import decoder_layers
from specbench.heads.model import EagleHead
from specbench.types import SpecbenchError, reason

LAYOUTS = ("eagle3", "speculators")
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
          "rope_theta", "head_dim", "max_position_embeddings", "vocab_size")


def save_head(head: EagleHead, folder: str | Path, layout: str = "eagle3", target_name: str = "",
              embeddings: bool = False) -> Path:
    """Write `head` to `folder` in `layout`; its embeddings only when they are its own, or `embeddings`
    asks for a copy of the target's (a head drafting on a worker's client has no target weights there;
    speculators: always)."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise SpecbenchError(f"unknown head layout {layout!r}; one of {LAYOUTS}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config
    state = {name: tensor.detach().contiguous() for name, tensor in head.state_dict().items()
             if not name.startswith("rotary.")}
    if layout == "eagle3":
        if getattr(head, "shares_embeddings", False) and not embeddings:
            state.pop("embed_tokens.weight", None)
        state = {name.replace("layers.0.", "midlayer.", 1): tensor for name, tensor in state.items()}
    layer = {key: getattr(config, key) for key in _SIZES if getattr(config, key) is not None}
    layer.update(num_hidden_layers=1, model_type="llama", tie_word_embeddings=False,
                 **{k: v for k, v in config.extra.items() if k in ("rope_scaling", "hidden_act")})
    if layout == "eagle3":
        document = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": config.draft_vocab_size,
                    "target_hidden_size": config.features_size, "norm_before_residual": config.norm_before_residual,
                    "eagle_config": {"use_aux_hidden_state": True,
                                     "eagle_aux_hidden_state_layer_ids": list(config.layer_ids)}}
    else:
        document = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                    "draft_vocab_size": config.draft_vocab_size, "norm_before_residual": config.norm_before_residual,
                    "target_hidden_size": config.features_size,
                    "eagle_aux_hidden_state_layer_ids": list(config.layer_ids), "transformer_layer_config": layer,
                    "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                           "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                           "verifier": {"name_or_path": target_name, "architectures": []}}}
    write_text(folder / "config.json", json.dumps(document, indent=1) + "\n")  # each file whole: checkpoints
    with replacing(folder / "model.safetensors") as temporary:  # overwrite them while a run may read them
        save_file(state, str(temporary), metadata={"format": "pt", "written_by": "specbench"})
    return folder


def read_config(folder: Path) -> tuple[HeadConfig, str]:
    """The head's config and its layout, from `config.json`."""
    path = folder / "config.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SpecbenchError(f"cannot read a draft head's config at {path}: {error}") from None
    if document.get("speculators_model_type") == "eagle3":
        layout, layer = "speculators", dict(document.get("transformer_layer_config") or {})
        ids = document.get("eagle_aux_hidden_state_layer_ids") or ()
    elif "draft_vocab_size" in document or any("eagle3" in a.lower() for a in document.get("architectures") or ()):
        layout, layer = "eagle3", document
        ids = (document.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
    else:
        raise SpecbenchError(f"{path} is not a draft head specbench reads: neither EAGLE-3's layout "
                             f"(LlamaForCausalLMEagle3, draft_vocab_size) nor speculators' (speculators_model_type "
                             f"'eagle3'); architectures {document.get('architectures')}")
    missing = [key for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
               if key not in layer]
    if missing:
        raise SpecbenchError(f"{path} ({layout} layout) lacks {missing}")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise SpecbenchError(f"{path}: a head of {layer['num_hidden_layers']} decoder layers; specbench runs "
                             f"EAGLE-3's one-layer head")
    config = HeadConfig(
        hidden_size=int(layer["hidden_size"]), intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(document.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"]),
        target_hidden_size=document.get("target_hidden_size") or layer.get("target_hidden_size"),
        layer_ids=tuple(int(i) for i in ids), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", 10000.0)), head_dim=layer.get("head_dim"),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        norm_before_residual=bool(document.get("norm_before_residual", False)),
        extra={k: layer[k] for k in ("rope_scaling", "hidden_act") if layer.get(k) is not None})
    return config, layout


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    binary = folder / "pytorch_model.bin"
    state = {}
    for file in files or ([binary] if binary.exists() else []):
        try:
            state.update(load_file(str(file)) if file.suffix == ".safetensors"
                         else torch.load(file, map_location="cpu", weights_only=True))
        except Exception as error:  # safetensors, zip and pickle readers each raise their own kinds
            raise SpecbenchError(f"cannot read a draft head's weights at {file}: {reason(error)}") from None
    if state:
        return state
    raise SpecbenchError(f"no weights in {folder} (model.safetensors or pytorch_model.bin)")


def _local(where: str | Path) -> Path:
    path = Path(where).expanduser()
    if path.is_dir():
        return path
    from specbench.models.hub import hub_kwargs, offline_reason

    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(where), allow_patterns=["*.json", "*.safetensors", "*.bin"], **hub_kwargs()))
    except Exception as error:  # noqa: BLE001 - offline, unknown id, no access: all say the same to a user
        offline = offline_reason()
        raise SpecbenchError(f"draft head {where!r}: not a folder here, and the Hugging Face hub did not give it "
                             f"({type(error).__name__}: {str(error)[:200]}){f'; {offline}' if offline else ''}") from None


def load_head(where: str | Path, target, dtype: Optional[torch.dtype] = None) -> EagleHead:
    """The head at `where` (a folder or a Hugging Face id), checked against `target` (a LoadedModel, or a
    RemoteTarget when the head drafts on the client of a worker) and sharing its input embeddings unless
    the checkpoint has its own (a remote target's are not here: such a head must have its own)."""
    folder = _local(where)
    config, layout = read_config(folder)
    shape = _TargetShape.of(target)
    config = config.fitted(shape.layers)
    if config.vocab_size != shape.vocab_size:
        raise SpecbenchError(f"draft head {where}: its vocabulary has {config.vocab_size} ids, the target's "
                             f"{shape.vocab_size}; a head drafts in its target's ids")
    if config.features_size != shape.hidden_size:
        raise SpecbenchError(f"draft head {where}: it reads features of size {config.features_size}, the target's "
                             f"hidden size is {shape.hidden_size}")
    state = {_name(name): tensor for name, tensor in _weights(folder).items()}
    own = "embed_tokens.weight" in state
    if not own and shape.embeddings is None:
        raise SpecbenchError(f"draft head {where} shares its target's embeddings, and the target runs on a worker: "
                             f"draft with it there (method 'eagle-server'), or write it with its own "
                             f"(save_head(..., embeddings=True), `specbench train-draft --own-embeddings`)")
    if not own and config.hidden_size != shape.hidden_size:
        raise SpecbenchError(f"draft head {where}: no embeddings of its own, and its hidden size "
                             f"{config.hidden_size} is not the target's {shape.hidden_size}")
    config = config if "fc.bias" not in state else replace(config, fc_bias=True)
    head = EagleHead(config, embed_tokens=None if own else shape.embeddings)
    head.shares_embeddings = not own
    expected = {name for name in head.state_dict() if not name.startswith("rotary.")}
    if not own:
        expected.discard("embed_tokens.weight")
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise SpecbenchError(f"draft head {where} ({layout} layout): weights missing {missing[:6]}, "
                             f"not understood {unknown[:6]}")
    try:
        head.load_state_dict(state, strict=False)
    except RuntimeError as error:
        raise SpecbenchError(f"draft head {where} ({layout} layout): {str(error).splitlines()[-1].strip()}") from None
    return head.to(dtype or shape.dtype).to(shape.device).eval()


@dataclass(frozen=True)
class _TargetShape:
    """What a head is checked against and borrows: from a model here, or a worker's description."""

    vocab_size: int
    hidden_size: int
    layers: int
    embeddings: Optional[torch.nn.Module]
    dtype: torch.dtype
    device: torch.device | str

    @classmethod
    def of(cls, target) -> "_TargetShape":
        info = getattr(target, "info", None)
        if isinstance(info, dict):  # a RemoteTarget: the worker says its sizes
            if info.get("hidden_size") is None or info.get("num_hidden_layers") is None:
                raise SpecbenchError("the worker does not say its model's hidden size and layers (an older worker): "
                                     "a head cannot be checked against it")
            return cls(int(info["vocab_size"]), int(info["hidden_size"]), int(info["num_hidden_layers"]), None,
                       torch.float32, "cpu")
        model = target.model
        embeddings = model.get_input_embeddings()
        return cls(target.vocab_size, model.config.hidden_size, len(decoder_layers(model)), embeddings, model.dtype,
                   embeddings.weight.device)


def _name(name: str) -> str:
    """A checkpoint's weight name as the head calls it: no `model.` prefix, `midlayer.` as `layers.0.`."""
    name = name[len("model."):] if name.startswith("model.") else name
    return name.replace("midlayer.", "layers.0.", 1)
