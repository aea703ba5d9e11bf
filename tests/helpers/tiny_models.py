"""Models, tokenizers and PEFT adapters the serving tests build for themselves.

The tiny Llama is random (seeded) and saved as a real Hugging Face checkpoint folder with a
byte-level BPE tokenizer trained here, so the engine loads it exactly as it loads a hub model.
Adapters are made by PEFT itself (``get_peft_model`` + ``save_pretrained``) with random A and B,
so their names, shapes and config are PEFT's, not ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
# The tiny decoder's shape, shared by every test that builds one (any family, any layer count).
TINY_SHAPE: dict[str, int] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a platform team serves many fine-tunes of one base model",
    "adapters are small, the base model is large, and memory is fixed",
    "continuous batching mixes prefill and decode in one step",
] * 20


def save_tokenizer(folder: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=320, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))


def make_tiny_llama(folder: Path, *, seed: int = 0, tie: bool = False, rope_scaling: dict | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **TINY_SHAPE,
        num_hidden_layers=3,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        rope_scaling=rope_scaling,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    save_tokenizer(folder)
    return folder


# name -> (rank, alpha, target modules, rsLoRA): four ranks, four target-module sets.
ADAPTER_SPECS: dict[str, tuple[int, int, list[str], bool]] = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp16": (16, 16, ["gate_proj", "down_proj", "o_proj"], False),
    "ku2": (2, 4, ["k_proj", "up_proj"], True),
}


def make_peft_adapter(
    base_folder: Path,
    out: Path,
    rank: int,
    alpha: int,
    targets: list[str],
    rslora: bool,
    *,
    seed: int,
    std: float = 0.05,
    base_name: str | None = None,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False,
        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    if base_name:  # PEFT records the local folder; adapters in the wild name the hub id
        config_file = out / "adapter_config.json"
        raw = json.loads(config_file.read_text())
        raw["base_model_name_or_path"] = base_name
        config_file.write_text(json.dumps(raw, indent=2))
    return out
