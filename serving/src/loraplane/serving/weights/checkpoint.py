"""Read a Hugging Face checkpoint folder (config.json + one or many safetensors shards) into the model.

Hugging Face names are mapped onto our fused projections: ``q_proj``/``k_proj``/``v_proj`` land
in their slices of ``qkv_proj``, ``gate_proj``/``up_proj`` in ``gate_up_proj``. Every parameter
of the model must be written exactly once; a missing or unexpected tensor is an error, not a
silently random weight.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from loraplane.serving.host_side import host_side
from loraplane.serving.model.layers import LoraLinear
from loraplane.serving.model.llama import DecoderLayer, LlamaModel


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold what the config promises."""


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" ({', '.join(pickles)} are pickle files, which this engine refuses to load)" if pickles else ""
        raise CheckpointError(f"{folder} has no safetensors weights{hint}")
    return found


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                with host_side():
                    tensor = f.get_tensor(name)
                yield name, tensor


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)\.?(\w*)\.(weight|bias)$")


def _slice(proj: LoraLinear, module: str, kind: str) -> torch.Tensor:
    i = proj.slice_names.index(module)
    start, size = proj.slice_offsets[i], proj.slice_sizes[i]
    target = proj.weight if kind == "weight" else proj.bias
    if target is None:
        raise CheckpointError(f"{module}.bias found, but the config has no attention biases")
    return target.data[start : start + size]


def _target(model: LlamaModel, name: str) -> torch.Tensor:
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight.data
    if name == "model.norm.weight":
        return model.norm.weight.data
    if name == "lm_head.weight":
        if model.lm_head is None:
            raise CheckpointError("lm_head.weight found, but the config ties word embeddings")
        return model.lm_head.data
    m = _LAYER.match(name)
    if not m or int(m.group(1)) >= len(model.layers):
        raise CheckpointError(f"unexpected tensor {name!r}")
    layer = model.layers[int(m.group(1))]
    assert isinstance(layer, DecoderLayer)
    part, module, kind = m.group(2), m.group(3), m.group(4)
    if part in ("input_layernorm", "post_attention_layernorm"):
        norm = layer.input_layernorm if part == "input_layernorm" else layer.post_attention_layernorm
        return norm.weight.data
    owners = {
        "q_proj": layer.self_attn.qkv_proj,
        "k_proj": layer.self_attn.qkv_proj,
        "v_proj": layer.self_attn.qkv_proj,
        "o_proj": layer.self_attn.o_proj,
        "gate_proj": layer.mlp.gate_up_proj,
        "up_proj": layer.mlp.gate_up_proj,
        "down_proj": layer.mlp.down_proj,
    }
    if module not in owners:
        raise CheckpointError(f"unexpected tensor {name!r}")
    return _slice(owners[module], module, kind)


def load_weights(model: LlamaModel, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    written: dict[str, int] = {}  # by name, not data pointer: a fake (traced) tensor has none
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target = _target(model, name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{name} has shape {list(tensor.shape)}, the config needs {list(target.shape)}")
        target.copy_(tensor)
        written[name] = target.numel()
    expected = sum(p.numel() for p in model.parameters())
    if sum(written.values()) != expected:
        raise CheckpointError(f"the checkpoint filled {sum(written.values())} of the model's {expected} weights")


def random_weights(model: LlamaModel, seed: int = 0) -> None:
    """Fill every weight at random (``load_format="dummy"``), on its own device: projections and
    embeddings from N(0, 0.02) as Llama initialises them, norms at one. Outputs are meaningless;
    shapes, memory and speed are the real model's."""
    g = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=g)
