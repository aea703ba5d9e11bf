"""The subset of a Hugging Face ``config.json`` the engine needs, for Llama, Mistral and Qwen2.

Read from the checkpoint's own file so that nothing here guesses a shape. Both spellings of the
rotary settings are accepted: ``rope_theta`` + ``rope_scaling`` (transformers 4) and
``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A checkpoint config the engine cannot run, with the field that decided it."""


class RopeScaling(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class LlamaConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = Field(default=None, description="attention window; the engine caps max_model_len to it")
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        rope = dict(raw.get("rope_parameters") or {})
        scaling = dict(raw.get("rope_scaling") or {})
        rope.update(scaling)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling(**{**rope, "rope_type": rope_type}),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            sliding_window=window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path}: {err}") from err
        return cls.from_hf_dict(raw)

    def context_limit(self) -> int:
        """Longest sequence the engine runs exactly: full attention is only the model's attention
        while the sequence fits its sliding window, so that bounds it too."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def inv_freq(self) -> list[float]:
        """Rotary inverse frequencies after the config's scaling (Llama 3's rule keeps high
        frequencies, divides low ones by ``factor`` and blends the band between)."""
        dim = self.head_dim
        freqs = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        s = self.rope_scaling
        if s.rope_type == "linear":
            return [f / s.factor for f in freqs]
        if s.rope_type != "llama3":
            return freqs
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / s.factor)
            else:
                smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
                out.append((1 - smooth) * f / s.factor + smooth * f)
        return out
