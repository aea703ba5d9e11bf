"""Write PEFT-format LoRA adapters with random weights for a base shape, quickly and without PEFT.

The files are what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` with PEFT's
field names, ``adapter_model.safetensors`` with PEFT's tensor names), so PEFT itself loads them
for the baseline and our validator checks them like any customer adapter. `loraplane bench` serves
hundreds of them in-process; the benchmarks under ``benchmarks/`` use them too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplane.adapter_format import LLAMA_TARGETS, BaseShape

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PEFT_DEFAULT = ("q_proj", "v_proj")


def seed_ranks(n: int, seed: int = 0) -> list[int]:
    """The issue's rank mix: 80% rank 8, 18% rank 16, 2% rank 64, shuffled reproducibly."""
    ranks = [64] * round(0.02 * n) + [16] * round(0.18 * n)
    ranks += [8] * (n - len(ranks))
    random.Random(seed).shuffle(ranks)
    return ranks


def write_adapter(
    folder: Path,
    base: BaseShape,
    rank: int,
    targets: tuple[str, ...] = LLAMA_TARGETS,
    *,
    seed: int,
    std: float = 0.01,
    dtype: torch.dtype = torch.float32,
) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module in targets:
            d_in, d_out = base.module_dims(module)
            part = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) * std).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g) * std).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.name,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
