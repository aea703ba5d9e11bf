"""PEFT's ``adapter_config.json`` for LoRA, as far as serving needs it.

Unknown keys are kept (PEFT adds fields every release); features that would change the math in
ways the kernels do not implement (DoRA, trained biases, full modules to save) are refused with a
message rather than served wrong. Per-module ranks and alphas (``rank_pattern``,
``alpha_pattern``) are read as PEFT reads them: each pattern a regular expression that must match
the end of a module's name, the first that matches winning.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import regex
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode
from loraplane.adapter_format.small_files import read_capped

MAX_RANK = 1 << 16
MAX_ALPHA = 1e6
# A pattern comes from whoever uploaded the adapter, and a regular expression can take
# exponential time: each match is bounded, and so are all of a config's matches together (the
# third-party ``regex`` engine can stop a match; the standard library's cannot), and each
# pattern's length.
MATCH_SECONDS = 0.05
PATTERN_BUDGET_SECONDS = 1.0
MAX_PATTERN_CHARS = 256
MAX_PATTERNS = 1024
# PEFT's LoRA variants, by their config fields (PEFT 0.21's fields tagged ``is_lora_variant``, and
# QALoRA's), and its initialisations that are variants too: each changes what a layer computes.
VARIANT_FIELDS = (
    "alora_invocation_tokens", "arrow_config", "kasa_config", "monteclora_config", "use_bdlora", "use_qalora", "velora_config",
)  # fmt: skip
VARIANT_CONFIGS = ("arrow_config", "kasa_config", "monteclora_config", "use_bdlora", "velora_config")
VARIANT_INITS = ("mica",)
# Initialisations that change the base's weights (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA): such an
# adapter is trained against that changed base, and PEFT changes the base again when it loads one.
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
Rank = Annotated[int, Field(gt=0, le=MAX_RANK)]
Alpha = Annotated[float, Field(gt=0, le=MAX_ALPHA, allow_inf_nan=False)]


class PeftLoraConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    peft_type: str = "LORA"
    # Bounded so the scaling is a finite number the kernels can multiply by: Python's JSON reader
    # accepts Infinity and NaN, and a rank beyond any base's width is a corrupt file.
    r: int = Field(gt=0, le=MAX_RANK)
    lora_alpha: float = Field(gt=0, le=MAX_ALPHA, allow_inf_nan=False)
    target_modules: list[str] | str
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    base_model_name_or_path: str | None = None
    revision: str | None = None
    modules_to_save: list[str] | None = None
    rank_pattern: dict[str, Rank] = Field(default_factory=dict, max_length=MAX_PATTERNS)
    alpha_pattern: dict[str, Alpha] = Field(default_factory=dict, max_length=MAX_PATTERNS)
    fan_in_fan_out: bool = False

    @field_validator("peft_type")
    @classmethod
    def _lora_only(cls, v: str) -> str:
        if v.upper() != "LORA":
            raise ValueError(f"peft_type {v!r} is not LORA")
        return v

    @field_validator("rank_pattern", "alpha_pattern")
    @classmethod
    def _patterns_compile(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if len(key) > MAX_PATTERN_CHARS:
                raise ValueError(f"pattern {key[:40]!r}... is longer than {MAX_PATTERN_CHARS} characters")
            try:
                _suffix_pattern(key)
            except regex.error as err:
                raise ValueError(f"pattern {key!r} is not a regular expression: {err}") from None
        return v

    @property
    def scaling(self) -> float:
        """alpha / r, or alpha / sqrt(r) for rsLoRA (Kalajdzievski, 2023), as PEFT computes it."""
        return self.scaling_at(self.r, self.lora_alpha)

    def scaling_at(self, r: int, alpha: float) -> float:
        return alpha / (math.sqrt(r) if self.use_rslora else r)

    def module_settings(self, modules: Iterable[str]) -> dict[str, tuple[int, float]]:
        """Each module's rank and what PEFT multiplies its ``B @ A`` by, after the rank and alpha
        patterns, by the module's name (``model.layers.3.self_attn.q_proj``). Each pattern is
        matched once per module, all of them within ``PATTERN_BUDGET_SECONDS``, or a
        ``ValueError``."""
        deadline = time.monotonic() + PATTERN_BUDGET_SECONDS
        settings = {}
        for module in modules:
            rank = int(_pattern_value(self.rank_pattern, module, self.r, deadline))
            alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha, deadline))
            settings[module] = (rank, self.scaling_at(rank, alpha))
        return settings

    def unsupported(self) -> list[str]:
        problems = []
        if self.use_dora:
            problems.append("DoRA (use_dora) is not supported by the gathered kernels")
        extra = self.model_extra or {}
        # PEFT makes a config object of any mapping given, ``{}`` too, and that turns the variant
        # on; the flags and the token list turn it on when true or not empty.
        variants = [
            name for name in VARIANT_FIELDS if (extra.get(name) is not None if name in VARIANT_CONFIGS else extra.get(name))
        ]
        if variants or extra.get("init_lora_weights") in VARIANT_INITS:
            named = ", ".join(variants) or f"init_lora_weights={extra['init_lora_weights']!r}"
            problems.append(
                f"{named}: a PEFT LoRA variant whose layers compute other than x A^T B^T, which is all that is served"
            )
        init = extra.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
            problems.append(
                f"init_lora_weights={init!r} trains against a changed base (PEFT changes the base's weights again when it "
                "loads such an adapter); save it with path_initial_model_for_weight_conversion, which makes it a plain LoRA"
            )
        if extra.get("layer_replication"):
            problems.append("layer_replication changes the base's layers")
        if self.bias != "none":
            problems.append(f"trained biases (bias={self.bias!r}) are not supported")
        if self.modules_to_save:
            problems.append(f"modules_to_save {self.modules_to_save} would replace base weights per adapter")
        if self.fan_in_fan_out:
            problems.append("fan_in_fan_out (Conv1D-style weights) is not a Llama layout")
        return problems


@functools.lru_cache(maxsize=MAX_PATTERNS)
def _suffix_pattern(key: str) -> regex.Pattern[str]:
    return regex.compile(rf"(.*\.)?({key})$")  # PEFT's get_pattern_key


def _pattern_value(patterns: dict[str, Any], module: str, default: Any, deadline: float) -> Any:
    """The value of the first pattern matching the end of ``module``'s name, as PEFT picks it; a
    match that runs past ``MATCH_SECONDS``, or past the ``deadline``, is a ``ValueError``."""
    over = f"matching rank_pattern and alpha_pattern took longer than {PATTERN_BUDGET_SECONDS:g} s"
    for key, value in patterns.items():
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(over)
        try:
            if _suffix_pattern(key).match(module, timeout=min(MATCH_SECONDS, left)):
                return value
        except TimeoutError:
            raise ValueError(over if left < MATCH_SECONDS else f"pattern {key!r} takes too long to match {module!r}") from None
    return default


# adapter_config.json is a few kilobytes; rank and alpha patterns for every module of a 128-layer
# model stay well under this. Checked before the file is parsed.
MAX_CONFIG_BYTES = 2**20


def load_peft_config(path: str | Path) -> PeftLoraConfig:
    path = Path(path)
    try:
        raw = json.loads(read_capped(path, MAX_CONFIG_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterValidationError(ErrorCode.BAD_CONFIG, f"{path.name} is not readable JSON: {exc}") from None
    try:
        config = PeftLoraConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "config"
        raise AdapterValidationError(ErrorCode.BAD_CONFIG, f"{path.name}: {field}: {first['msg']}") from None
    problems = config.unsupported()
    if problems:
        raise AdapterValidationError(ErrorCode.BAD_CONFIG, f"{path.name}: " + "; ".join(problems))
    return config
