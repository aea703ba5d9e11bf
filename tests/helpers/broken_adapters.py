"""Broken copies of a good PEFT adapter, one per way an upload goes wrong: what the validation rules
must refuse, each with its own reason (the engine's tests and the operator's use the same ones)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path


def corrupt(folder: Path, out: Path, how: str) -> Path:
    shutil.copytree(folder, out)
    weights = out / "adapter_model.safetensors"
    if how == "nan":
        raw = bytearray(weights.read_bytes())
        header = struct.unpack("<Q", raw[:8])[0]
        raw[8 + header : 8 + header + 4] = struct.pack("<f", float("nan"))
        weights.write_bytes(bytes(raw))
    elif how == "base":
        config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "meta-llama/Llama-3-8B"}))
    elif how == "rank":
        config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**config, "r": 6}))
    elif how == "pickle":
        (out / "adapter_model.bin").write_bytes(b"\x80\x04")
    elif how == "missing":
        weights.unlink()
    elif how == "config":
        (out / "adapter_config.json").write_text("{not json")
    elif how in ("target", "layer", "half", "empty"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        if how == "target":
            tensors = {k.replace("q_proj", "lm_head"): v for k, v in tensors.items()}
        elif how == "layer":
            tensors = {k.replace("layers.0.", "layers.99."): v for k, v in tensors.items()}
        elif how == "half":
            tensors = {k: v for k, v in tensors.items() if "lora_B" not in k or "layers.1." not in k}
        else:
            tensors = {}
        save_file(tensors, str(weights))
    return out
