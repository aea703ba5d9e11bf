"""Convert a GGUF file (llama architecture) into a Hugging Face checkpoint folder, once.

The folder lands in the cache under the GGUF's sha256, so a second start reads plain
safetensors in a fraction of a second and every later step (loading, fingerprinting, the
transformers reference in the tests) sees one format. Quantised tensors are dequantised with
the ``gguf`` package; q/k rows are put back from llama.cpp's interleaved rotary layout into the
rotate-half layout Hugging Face checkpoints and PEFT adapters use. The tokenizer and its chat
template come from the GGUF metadata through transformers' own GGUF tokenizer converter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from loraplane.adapter_format import file_digest
from loraplane.serving.model.llama_config import ConfigError

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows (0, 2, 4, ..., 1, 3, 5, ...)
    of the rotate-half layout were interleaved into adjacent pairs."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(reader: Any, has_output: bool) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens", [])))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
    }


def _tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, config["num_key_value_heads"])
        out[name] = torch.from_numpy(w.copy())
    return out


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """The checkpoint folder for ``gguf_path``, converting it on first use. Safe against two
    processes converting at once: each writes a private folder and renames it into place."""
    digest = file_digest(gguf_path).removeprefix("sha256:")
    target = cache_dir / "bases" / digest[:32]
    if (target / "config.json").is_file():
        return target
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = hf_config(reader, has_output)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        save_file(_tensors(reader, config), str(work / "model.safetensors"), metadata={"format": "pt"})
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(work))
        (work / "config.json").write_text(json.dumps(config, indent=2))
        (work / "source.json").write_text(json.dumps({"gguf": str(gguf_path), "gguf_digest": f"sha256:{digest}"}, indent=2))
        try:
            os.rename(work, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
