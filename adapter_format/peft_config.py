"""PEFT's ``adapter_config.json`` for LoRA, as far as serving needs it.

Unknown keys are kept (PEFT adds fields every release); features that would change the math in
ways the kernels do not implement (DoRA, per-module rank or alpha patterns, trained biases, full
modules to save) are refused with a message rather than served wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from loraplane.adapter_format.errors import AdapterValidationError, ErrorCode

MAX_RANK = 1 << 16
MAX_ALPHA = 1e6


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
    rank_pattern: dict[str, Any] = Field(default_factory=dict)
    alpha_pattern: dict[str, Any] = Field(default_factory=dict)
    fan_in_fan_out: bool = False

    @field_validator("peft_type")
    @classmethod
    def _lora_only(cls, v: str) -> str:
        if v.upper() != "LORA":
            raise ValueError(f"peft_type {v!r} is not LORA")
        return v

    @property
    def scaling(self) -> float:
        """alpha / r, or alpha / sqrt(r) for rsLoRA (Kalajdzievski, 2023), as PEFT computes it."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def unsupported(self) -> list[str]:
        problems = []
        if self.use_dora:
            problems.append("DoRA (use_dora) is not supported by the gathered kernels")
        if self.bias != "none":
            problems.append(f"trained biases (bias={self.bias!r}) are not supported")
        if self.modules_to_save:
            problems.append(f"modules_to_save {self.modules_to_save} would replace base weights per adapter")
        if self.rank_pattern or self.alpha_pattern:
            problems.append("per-module rank_pattern/alpha_pattern is not supported")
        if self.fan_in_fan_out:
            problems.append("fan_in_fan_out (Conv1D-style weights) is not a Llama layout")
        return problems


def load_peft_config(path: str | Path) -> PeftLoraConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
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
