"""Read a PEFT adapter folder into per-layer (A, B) pairs after the shared validation passes.

The rules live in :mod:`loraplane.adapter_format` (the operator runs the same ones); this file
only maps PEFT's tensor names onto (layer, module) and reads the weights with safetensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from loraplane.adapter_format import AdapterManifest, BaseShape, ValidationLimits, validate_adapter_dir
from loraplane.adapter_format.digest import WEIGHTS_FILE
from loraplane.serving import cuda_runtime
from loraplane.serving.host_side import host_side
from loraplane.serving.lora.rank_cap import truncate_adapter

_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoadedAdapter:
    manifest: AdapterManifest
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int
    folder: Path
    truncation_error: float | None = None  # relative Frobenius error when reduced to the rank cap

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def digest(self) -> str:
        return self.manifest.digest


def _uniform(
    a: torch.Tensor, b: torch.Tensor, manifest: AdapterManifest, key: tuple[int, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A module given its own rank or alpha by PEFT's patterns, made one of the adapter's
    rank and scaling: zero rows of A and columns of B up to the adapter's rank (they add nothing
    to ``B @ A``), and B times its scaling over the adapter's. Every slot, page and kernel then
    sees one rank and one scaling per adapter, at the cost of the padding's memory."""
    scaling = manifest.module_scalings.get(key)
    if scaling is not None:
        b = (b.float() * (scaling / manifest.scaling)).to(b.dtype)
    missing = manifest.rank - a.shape[0]
    if missing:
        a = torch.cat([a, a.new_zeros(missing, a.shape[1])])
        b = torch.cat([b, b.new_zeros(b.shape[0], missing)], dim=1)
    return a, b


def load_peft_adapter(
    folder: str | Path,
    base: BaseShape,
    limits: ValidationLimits,
    *,
    expected_digest: str | None = None,
    weights_digest: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoadedAdapter:
    folder = Path(folder)
    manifest = validate_adapter_dir(folder, base, limits, expected_digest=expected_digest, weights_digest=weights_digest)
    with host_side():
        raw = load_file(str(folder / WEIGHTS_FILE))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        m = _NAME.search(name)
        assert m, f"validation accepted {name!r}"  # the validator uses the same pattern
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor.to(dtype)
    weights = {key: _uniform(p["A"], p["B"], manifest, key) for key, p in pairs.items()}
    if cuda_runtime.available():
        # The host tier in page-locked memory: host -> device copies then run asynchronously at full bus speed.
        weights = {key: (a.pin_memory(), b.pin_memory()) for key, (a, b) in weights.items()}
    if manifest.needs_truncation:
        weights, error = truncate_adapter(weights, limits.max_lora_rank)
        return LoadedAdapter(manifest, weights, limits.max_lora_rank, folder, truncation_error=error)
    return LoadedAdapter(manifest, weights, manifest.rank, folder)
