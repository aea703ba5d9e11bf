"""The engine's sizing knobs, defined once for both sides of the operator's ConfigMap.

The operator writes a serving pod's ``engine.yaml`` from the BaseModel's ``spec.engine``; the
engine reads it into ``EngineConfig``. Both models derive from :class:`EngineSizing`, so each
knob's name (vLLM's), bounds, meaning and default, and the rule across knobs, are written here
and nowhere else; the CRD spells the names in camelCase. Like the admin bodies, this crosses a
release boundary (the operator and serving images upgrade separately).

``max_num_seqs`` and ``max_num_batched_tokens`` default by device, as vLLM's do: a GPU batches
far more than a CPU can step in reasonable time. ``None`` (unset) means that default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from loraplane.eviction import OnlinePolicyName

# (max_num_seqs, max_num_batched_tokens) when unset: vLLM's online-serving defaults on a GPU; on a
# CPU, what a few cores step without one prefill stalling every decode for seconds.
BATCH_DEFAULTS = {"cuda": (256, 8192), "cpu": (64, 2048)}


class EngineSizing(BaseModel):
    max_loras: int = Field(default=8, ge=1, le=4096, description="adapters resident at once (device slots)")
    # Described in the CRD reference's notes (its refusal reasons are the operator's).
    max_lora_rank: int = Field(default=16, ge=1, le=512)
    max_cpu_loras: int | None = Field(
        default=None, ge=1, description="adapters kept in host memory, no fewer than the device slots; default 4 per device slot"
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="sequences in a batch at once; default 256 on a GPU, 64 on a CPU"
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        description="tokens in one scheduler step (decodes plus prefill chunks); default 8192 on a GPU, 2048 on a CPU",
    )
    max_model_len: int | None = Field(default=None, ge=1, description="context length; default: min(the model's context, 4096)")
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="share of the GPU's memory the engine may use; the KV cache (or page pool) gets what the weights, "
        "adapter slots and activations leave of it, unless kv_cache_memory_mb or num_kv_blocks is set",
    )
    lora_memory: Literal["static", "unified"] = Field(
        default="static",
        description="static: every device slot reserves the largest rank (vLLM); unified: adapters take pages of the "
        "KV pool sized to their rank (S-LoRA), and the slot count only bounds how many are resident",
    )
    eviction_policy: OnlinePolicyName = Field(
        default="demand",
        description="which idle, unpinned adapter leaves a tier first (device and host); demand also keeps the hottest "
        "adapters in their slots and drains the least-demanded busy one for a waiting adapter",
    )
    require_adapter_digest: bool = Field(
        default=True,
        description="refuse an adapter whose declared digest is of adapter_model.safetensors alone (the earlier "
        "form, accepted only when this is false); the adapter digest also covers adapter_config.json and the golden "
        "outputs",
    )

    @model_validator(mode="after")
    def _host_holds_device(self) -> EngineSizing:
        """The host tier holds every device-resident adapter (vLLM's ``max_cpu_loras >= max_loras``),
        so a device eviction never costs a cold load. Named as the model spells its fields."""
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            fields = type(self).model_fields
            cpu, dev = (fields[f].alias or f for f in ("max_cpu_loras", "max_loras"))
            raise ValueError(
                f"{cpu} must be at least {dev} (here {self.max_cpu_loras} < {self.max_loras}): the host tier holds "
                "every device-resident adapter"
            )
        return self

    @property
    def host_slots(self) -> int:
        return self.max_cpu_loras or 4 * self.max_loras

    def batch_limits(self, device: Literal["cuda", "cpu"]) -> tuple[int, int]:
        """``(max_num_seqs, max_num_batched_tokens)``, each the setting or the device's default."""
        seqs, tokens = BATCH_DEFAULTS[device]
        return self.max_num_seqs or seqs, self.max_num_batched_tokens or tokens
