"""Validate a PEFT LoRA adapter folder against a base before anything serves it.

Each rule raises :class:`AdapterValidationError` with its own code. The order is cheapest and
most explanatory first: file layout, config, digest, base identity, then every tensor's name and
shape against the base (each module at its own rank when ``rank_pattern`` gives it one), the rank
against the cap, then the values themselves (NaN/Inf).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loraplane.adapter_format.base_shape import LLAMA_TARGETS, BaseShape
from loraplane.adapter_format.digest import CONFIG_FILE, WEIGHTS_FILE, adapter_digest, file_digests, parse_digest
from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode
from loraplane.adapter_format.golden import load_golden
from loraplane.adapter_format.peft_config import PeftLoraConfig, load_peft_config
from loraplane.adapter_format.safetensors_header import TensorInfo, read_safetensors_header

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
FLOAT_DTYPES = ("F32", "F16", "BF16")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT); the adapter-name infix
# (lora_A.default.weight) appears in some saved files and is accepted.
_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


# The largest adapter weights file accepted by default: the engine's ``max_adapter_bytes``, the
# operator's check and every fetch's cap (one figure, so a file one accepts the others do).
MAX_WEIGHTS_BYTES = 2 * 2**30


@dataclass(frozen=True)
class ValidationLimits:
    max_lora_rank: int = 64
    max_bytes: int = MAX_WEIGHTS_BYTES
    allow_rank_truncation: bool = False
    supported_modules: tuple[str, ...] = LLAMA_TARGETS
    # Refuse a declared digest of the weights file alone (the earlier form), which leaves the
    # config and the golden outputs free to change under it; False accepts it, for a migration.
    require_adapter_digest: bool = True


@dataclass(frozen=True)
class AdapterManifest:
    """What validation learned about an adapter; the engine loads exactly this."""

    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    layers: tuple[int, ...]
    digest: str  # the weights file's
    size_bytes: int
    dtype: str
    needs_truncation: bool = False
    tensors: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    # (layer, module) -> its own scaling, where rank_pattern or alpha_pattern give it one other
    # than ``scaling``; the loader rescales those (and pads every module below ``rank``, the
    # largest, which its tensors' shapes tell).
    module_scalings: dict[tuple[int, str], float] = field(default_factory=dict, repr=False)
    adapter_digest: str = ""  # config, weights and golden outputs (adapter_format.digest)
    # What the declared digest covered: "adapter", "weights" (the earlier form), or None when
    # nothing was declared.
    digest_scope: str | None = None


def _fail(code: ErrorCode, message: str) -> AdapterValidationError:
    return AdapterValidationError(code, message)


def _check_files(folder: Path) -> None:
    if not folder.is_dir():
        raise _fail(ErrorCode.MISSING_FILE, f"{folder} is not a folder")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise _fail(
            ErrorCode.PICKLE_REFUSED,
            f"{', '.join(pickles)}: pickle files can run code when loaded; save the adapter with safetensors "
            "(PEFT's save_pretrained(..., safe_serialization=True))",
        )
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise _fail(ErrorCode.MISSING_FILE, f"{name} is missing from {folder.name}")


def same_model(declared: str, served: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the served base. Two hub ids
    (``org/name``) must be the same id, so ``org-a/llama`` is not ``org-b/llama``; a local path the
    trainer loaded from (``/data/llama``, ``./llama``) can only be matched by its last segment.
    Case is ignored, as the hub ignores it."""

    def hub_id(name: str) -> bool:
        return name.count("/") == 1 and not name.startswith(("/", ".", "~"))

    if hub_id(declared) and hub_id(served):
        return declared.lower() == served.lower()
    return declared.rstrip("/").split("/")[-1].lower() == served.rstrip("/").split("/")[-1].lower()


def _check_base(config: PeftLoraConfig, base: BaseShape) -> None:
    declared = config.base_model_name_or_path
    # Only a shape with no identity (an empty name: a bare shape, as in the simulator) skips the
    # name check; a served base always has one (serving/weights/base.py resolve_base).
    if declared and base.name and not same_model(declared, base.name):
        raise _fail(ErrorCode.BASE_MISMATCH, f"adapter was trained on {declared!r}, this base is {base.name!r}")
    if config.revision and base.revision and config.revision != base.revision:
        raise _fail(
            ErrorCode.BASE_MISMATCH,
            f"adapter was trained on revision {config.revision!r} of its base, this base is revision {base.revision!r}; "
            "outputs would degrade quietly, so it is refused",
        )
    fingerprint = getattr(config, "base_model_fingerprint", None)
    if fingerprint and base.fingerprint and fingerprint != base.fingerprint:
        raise _fail(
            ErrorCode.BASE_MISMATCH, f"adapter's base fingerprint {fingerprint} differs from this base's {base.fingerprint}"
        )


def module_path(tensor: str) -> str:
    """The name of the module a LoRA tensor belongs to, as PEFT's patterns match it
    (``model.layers.3.self_attn.q_proj``)."""
    path = tensor[: tensor.index(".lora_")]
    return path.removeprefix("base_model.model.")


@dataclass
class _Modules:
    """What the tensors showed: the modules and layers adapted, their one dtype, and each
    module's rank and scaling from the config's patterns."""

    names: set[str]
    layers: set[int]
    dtype: str
    ranks: dict[tuple[int, str], int]
    scalings: dict[tuple[int, str], float]


def _module_settings(config: PeftLoraConfig, tensors: dict[str, TensorInfo]) -> dict[str, tuple[int, float]]:
    """Each adapted module's rank and scaling, read from the config's patterns once per module."""
    paths = {module_path(name) for name in tensors if _TENSOR.match(name)}
    try:
        return config.module_settings(sorted(paths))
    except ValueError as err:  # a pattern that takes too long to match
        raise _fail(ErrorCode.BAD_CONFIG, f"{CONFIG_FILE}: {err}") from None


def _check_tensors(tensors: dict[str, TensorInfo], config: PeftLoraConfig, base: BaseShape, limits: ValidationLimits) -> _Modules:
    modules: set[str] = set()
    layers: set[int] = set()
    pairs: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    ranks: dict[tuple[int, str], int] = {}
    scalings: dict[tuple[int, str], float] = {}
    settings = _module_settings(config, tensors)
    dtypes = set()
    for name, info in tensors.items():
        m = _TENSOR.match(name)
        if not m:
            raise _fail(ErrorCode.UNSUPPORTED_TARGET, f"tensor {name!r} is not a LoRA A/B weight of a decoder layer")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in limits.supported_modules:
            raise _fail(
                ErrorCode.UNSUPPORTED_TARGET,
                f"tensor {name!r} targets {module!r}; supported: {', '.join(limits.supported_modules)}",
            )
        if layer >= base.num_layers:
            raise _fail(ErrorCode.SHAPE_MISMATCH, f"tensor {name!r} is for layer {layer}, the base has {base.num_layers} layers")
        if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
            raise _fail(
                ErrorCode.SHAPE_MISMATCH,
                f"tensor {name!r} must be a 2-D {'/'.join(FLOAT_DTYPES)} matrix, got {info.dtype} {list(info.shape)}",
            )
        rank, scaling = settings[module_path(name)]
        d_in, d_out = base.module_dims(module)
        expected = (rank, d_in) if which == "A" else (d_out, rank)
        if info.shape != expected:
            raise _fail(
                ErrorCode.SHAPE_MISMATCH,
                f"tensor {name!r} has shape {list(info.shape)}, the base needs {list(expected)} at rank {rank}",
            )
        ranks[layer, module], scalings[layer, module] = rank, scaling
        pairs.setdefault((layer, module), {})[which] = info
        modules.add(module)
        layers.add(layer)
        dtypes.add(info.dtype)
    if not pairs:
        raise _fail(
            ErrorCode.NO_MATCHING_TENSORS, "no tensor maps onto a layer of the base; the adapter would load as a silent no-op"
        )
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise _fail(ErrorCode.SHAPE_MISMATCH, f"layer {layer} {module} has no lora_{missing} weight")
    if len(dtypes) > 1:
        raise _fail(ErrorCode.SHAPE_MISMATCH, f"mixed tensor dtypes {sorted(dtypes)}; save all LoRA weights in one dtype")
    return _Modules(modules, layers, dtypes.pop(), ranks, scalings)


_EXPONENT = {"F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80)}


def _check_finite(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """A value is NaN or Inf exactly when its exponent bits are all ones; testing bits also covers
    bf16, which numpy has no float type for."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in tensors.items():
        bits, mask = _EXPONENT[info.dtype]
        raw = np.frombuffer(buffer[info.offsets[0] : info.offsets[1]], dtype=bits)
        if np.any((raw & bits(mask)) == bits(mask)):
            raise _fail(ErrorCode.CORRUPT_SAFETENSORS, f"tensor {name!r} contains NaN or Inf")


def _digest_scope(declared: str, whole: str, weights: str, limits: ValidationLimits) -> str:
    """Which digest the manifest declared; anything else is a mismatch naming both."""
    if declared == whole:
        return "adapter"
    if declared == weights and not limits.require_adapter_digest:
        return "weights"
    if declared == weights:
        raise _fail(
            ErrorCode.DIGEST_MISMATCH,
            f"the declared digest {declared} covers only {WEIGHTS_FILE}; this server requires the adapter's digest "
            f"{whole} (config, weights and golden outputs; `loraplane digest FOLDER` prints it; "
            f"requireAdapterDigest: false accepts the earlier form)",
        )
    raise _fail(
        ErrorCode.DIGEST_MISMATCH,
        f"the adapter's digest is {whole} (its {WEIGHTS_FILE}'s {weights}); the manifest declares {declared}",
    )


def validate_adapter_dir(
    folder: str | Path,
    base: BaseShape,
    limits: ValidationLimits = ValidationLimits(),
    *,
    expected_digest: str | None = None,
    weights_digest: str | None = None,
) -> AdapterManifest:
    """``weights_digest``: the weights file's digest when the caller has just computed it from
    this very file (the engine's disk cache does as it writes or verifies a folder), so a large
    file is not hashed a second time."""
    folder = Path(folder)
    _check_files(folder)
    config = load_peft_config(folder / CONFIG_FILE)
    if config.r > limits.max_lora_rank and not limits.allow_rank_truncation:
        # The declared rank, before any tensor is read (vLLM refuses it so, with this wording).
        raise _fail(
            ErrorCode.RANK_OVER_CAP,
            f"LoRA rank {config.r} is greater than max_lora_rank {limits.max_lora_rank}; retrain at a lower rank or opt in "
            "to truncation",
        )
    load_golden(folder)  # its caps and its token budget, refused here rather than on the replica that replays it
    weights = folder / WEIGHTS_FILE
    size = weights.stat().st_size
    if size > limits.max_bytes:
        raise _fail(ErrorCode.TOO_LARGE, f"{WEIGHTS_FILE} is {size} bytes, the limit is {limits.max_bytes}")
    digests = file_digests(folder, weights_digest)
    digest, whole = digests[WEIGHTS_FILE], adapter_digest(folder, digests)
    scope = None if expected_digest is None else _digest_scope(parse_digest(expected_digest), whole, digest, limits)
    _check_base(config, base)
    if isinstance(config.target_modules, list):
        unknown = sorted(set(config.target_modules) - set(limits.supported_modules))
        if unknown:
            raise _fail(
                ErrorCode.UNSUPPORTED_TARGET,
                f"target_modules {unknown} are not supported; supported: {', '.join(limits.supported_modules)}",
            )
    tensors = read_safetensors_header(weights)
    found = _check_tensors(tensors, config, base, limits)
    # The adapter's rank is its largest module's (rank_pattern may give modules their own).
    rank = max(found.ranks.values())
    needs_truncation = rank > limits.max_lora_rank
    if needs_truncation and not limits.allow_rank_truncation:
        raise _fail(
            ErrorCode.RANK_OVER_CAP,
            f"rank {rank} is above max_lora_rank {limits.max_lora_rank}; retrain at a lower rank or opt in to truncation",
        )
    _check_finite(weights, tensors)
    scaling = config.scaling
    return AdapterManifest(
        rank=rank,
        alpha=config.lora_alpha,
        scaling=scaling,
        target_modules=tuple(m for m in limits.supported_modules if m in found.names),
        layers=tuple(sorted(found.layers)),
        digest=digest,
        adapter_digest=whole,
        digest_scope=scope,
        size_bytes=size,
        dtype=found.dtype,
        needs_truncation=needs_truncation,
        tensors=tensors,
        module_scalings={key: s for key, s in found.scalings.items() if s != scaling},
    )
