"""Model shapes the benchmarks build engines of, with random weights (``load_format="dummy"``):
a folder with a ``config.json`` and a small tokenizer is all such an engine reads. Prompts in
these benchmarks are token ids; the tokenizer only turns generated ids into text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
TOY_CONFIG: dict[str, Any] = LLAMA3_8B_CONFIG | {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_CORPUS = ["the quick brown fox jumps over the lazy dog", "serve many adapters of one base model", "0123456789 .,;:!?"]


def write_shape(folder: Path, config: dict[str, Any]) -> Path:
    """``folder`` with ``config.json`` and a byte-level BPE tokenizer of a few hundred tokens."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if not (folder / "tokenizer.json").exists():
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            _CORPUS, vocab_size=300, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        )
        tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
        tok.save_pretrained(str(folder))
    return folder
