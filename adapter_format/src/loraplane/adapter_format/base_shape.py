"""The base model as adapter validation sees it: layer shapes, identity and revision.

The engine fills one from the weights it loaded (including a content hash); the operator reads
one from the BaseModel resource; the planner uses one to size adapters from their rank.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class BaseShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        default="", description="model id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct; empty for a shape with no identity"
    )
    revision: str | None = Field(default=None, description="commit or tag of the base an adapter must be trained on")
    fingerprint: str | None = Field(default=None, description="sha256 over architecture, shapes and weights")
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0, description="defaults to hidden_size / num_attention_heads")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a Llama-family target module."""
        q = self.num_attention_heads * self.resolved_head_dim
        kv = self.num_kv_heads * self.resolved_head_dim
        dims = {
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in dims:
            raise KeyError(f"unknown target module {module!r}; supported: {', '.join(LLAMA_TARGETS)}")
        return dims[module]

    def adapter_bytes(self, rank: int, modules: tuple[str, ...] | list[str] = LLAMA_TARGETS, dtype_bytes: int = 2) -> int:
        """A (rank x in) and B (out x rank) for each target module in every layer."""
        per_layer = sum(sum(self.module_dims(m)) for m in modules)
        return rank * per_layer * self.num_layers * dtype_bytes
