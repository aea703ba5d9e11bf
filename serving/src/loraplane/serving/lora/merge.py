"""Fold one adapter into its base: ``W + scale · B A`` for every module it targets, written as a
checkpoint folder any replica serves as a base (the merged model of a dedicated deployment).

The adapter is read the way the engine reads it for serving (``load_peft_adapter``: the shared
validation, rank and alpha patterns, rsLoRA, each module's scaling folded into its B), so the
merged model computes what the served adapter computes, with no second reading of PEFT's format
to drift. The arithmetic is done in float32 and stored in the base's dtype, shard by shard (one
shard in memory at a time, as the base is laid out). Every other file of the base folder
(config, tokenizer, chat template, shard index) is copied unchanged, so the merged folder is a
base like the original: same architecture, and a new identity (its weights' digests differ, so
its fingerprint does too), plus ``merged_from.json`` saying which base and which adapter version
it is. PEFT's ``merge_and_unload`` is the reference (tests/serving/test_merge.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraplane.adapter_format import ValidationLimits
from loraplane.serving.config import EngineConfig
from loraplane.serving.host_side import host_side
from loraplane.serving.lora.adapter_files import AdapterFiles
from loraplane.serving.lora.peft_loader import load_peft_adapter
from loraplane.serving.weights.base import PROVENANCE, BaseCheckpoint, resolve_base
from loraplane.serving.weights.checkpoint import shard_files

_MODULE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight$")


@dataclass(frozen=True)
class MergedCheckpoint:
    folder: Path
    modules: int  # weight matrices changed
    adapter_digest: str


def merge_adapter(base: BaseCheckpoint, adapter: Path, out: Path, *, expected_digest: str | None = None) -> MergedCheckpoint:
    """Write ``base`` with ``adapter`` folded in to the new folder ``out`` (written beside it and
    renamed into place, so ``out`` is whole or absent). ``expected_digest``: the adapter version
    to merge, checked as a load checks it."""
    if out.exists():
        raise FileExistsError(f"{out} exists; a merged checkpoint is written once, to a new folder")
    # No rank cap and no size cap: a merge changes no slot, so nothing is truncated.
    limits = ValidationLimits(max_lora_rank=512, max_bytes=1 << 40)
    loaded = load_peft_adapter(adapter, base.shape, limits, expected_digest=expected_digest, dtype=torch.float32)
    scale = loaded.manifest.scaling
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shards = set(shard_files(base.folder))
        for item in base.folder.iterdir():
            if item.is_file() and item not in shards and item.name != PROVENANCE:
                shutil.copy2(item, staging / item.name)
        changed = 0
        for shard in sorted(shards):
            tensors: dict[str, torch.Tensor] = {}
            metadata: dict[str, str] | None
            with safe_open(str(shard), framework="pt") as f:
                metadata = f.metadata()
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    with host_side():
                        tensor = f.get_tensor(name)
                    m = _MODULE.match(name)
                    pair = loaded.weights.get((int(m.group(1)), m.group(2))) if m else None
                    if pair is not None:
                        a, b = pair
                        tensor = (tensor.float() + scale * (b.float() @ a.float())).to(tensor.dtype)
                        changed += 1
                    tensors[name] = tensor.contiguous()
            save_file(tensors, str(staging / shard.name), metadata=metadata)
        if changed != len(loaded.weights):
            raise ValueError(f"the adapter targets {len(loaded.weights)} modules, the base holds {changed} of them")
        provenance = {
            "base": {"name": base.shape.name, "fingerprint": base.shape.fingerprint},
            "adapter": {"digest": loaded.manifest.adapter_digest, "rank": loaded.rank, "scaling": scale, "modules": changed},
        }
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return MergedCheckpoint(out, changed, loaded.manifest.adapter_digest)


def merged_at_start(base: BaseCheckpoint, files: AdapterFiles, config: EngineConfig) -> BaseCheckpoint:
    """A dedicated replica's model: ``config.merged_lora`` fetched as any adapter is (the node
    agent's cache or the pod's own, its digest checked), merged into ``base`` once per pod disk
    (a container restart finds the folder and skips the merge) and served under
    ``served_model_name``. The folder is named by the base's fingerprint and the adapter's weights,
    so a promoted version merges anew beside the old, never over a folder in use."""
    assert config.merged_lora is not None and config.served_model_name is not None  # EngineConfig's rule
    held = files.acquire(config.merged_lora, config.merged_lora_digest)
    try:
        key = hashlib.sha256(f"{base.shape.fingerprint}|{held.weights_digest}".encode()).hexdigest()[:32]
        out = config.cache_dir / "merged" / key
        if not (out / PROVENANCE).is_file():
            shutil.rmtree(out, ignore_errors=True)  # only a whole folder is renamed into place; nothing else is here
            merge_adapter(base, held.folder, out, expected_digest=config.merged_lora_digest)
    finally:
        files.release(held)
    return resolve_base(str(out), config.cache_dir, name=config.served_model_name, revision=base.shape.revision)
