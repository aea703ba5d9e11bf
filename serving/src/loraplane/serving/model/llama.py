"""A Llama-family decoder over a flat batch of tokens from many sequences.

The batch has no padding: ``input_ids`` is every scheduled token of every sequence, one after
another, and :class:`StepContext` says which rows belong to which sequence, where their keys
live and which adapter slot each row uses. Logits are computed only for the rows the sampler
needs (the last token of each sequence that finishes its prompt or decodes this step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from loraplane.serving.model import cpu_gemm
from loraplane.serving.model.attention import KVCache, paged_attention
from loraplane.serving.model.context import StepContext
from loraplane.serving.model.layers import LoraLinear, RMSNorm, RotaryEmbedding, Rotation
from loraplane.serving.model.llama_config import LlamaConfig


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = LoraLinear(
            cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], ["q_proj", "k_proj", "v_proj"], bias=cfg.attention_bias
        )
        self.o_proj = LoraLinear(cfg.q_size, [cfg.hidden_size], ["o_proj"])

    def forward(self, x: torch.Tensor, ctx: StepContext, rotary: RotaryEmbedding | Rotation, cache: KVCache) -> torch.Tensor:
        """``rotary``: the model's table (the fused path rotates in one kernel) or the step's rows'
        ``Rotation``, looked up once for every layer (the eager path)."""
        qkv = self.qkv_proj(x, ctx.lora)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[:, :q_size].view(-1, self.heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, self.kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, self.kv_heads, self.head_dim)
        if isinstance(rotary, RotaryEmbedding):
            rotary.fused(ctx.positions, q, k)
        else:  # queries and keys side by side, rotated by one set of ops
            qk = rotary.rotated(qkv[:, : q_size + kv_size].view(-1, self.heads + self.kv_heads, self.head_dim))
            q, k = qk[:, : self.heads], qk[:, self.heads :]
        out = paged_attention(q, k, v, cache.k[self.layer], cache.v[self.layer], ctx)
        projected: torch.Tensor = self.o_proj(out.reshape(-1, q_size), ctx.lora)
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = LoraLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, ["gate_proj", "up_proj"])
        self.down_proj = LoraLinear(cfg.intermediate_size, [cfg.hidden_size], ["down_proj"])

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, ctx.lora)
        if ctx.fused:
            h = gate_up.new_empty(gate_up.shape[0], self.intermediate)
            torch.ops.loraplane.silu_and_mul(gate_up, h)
        else:
            h = F.silu(gate_up[:, : self.intermediate])  # then multiplied in place: one tensor fewer
            h.mul_(gate_up[:, self.intermediate :])
        down: torch.Tensor = self.down_proj(h, ctx.lora)
        return down


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: StepContext, rotary: Rotation, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rotary, cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x), ctx)
        return out

    def fused(
        self, delta: torch.Tensor | None, residual: torch.Tensor, ctx: StepContext, rotary: RotaryEmbedding, cache: KVCache
    ) -> torch.Tensor:
        """The same layer with its residual adds folded into its norms: ``residual`` is the stream
        (updated in place), ``delta`` what the previous layer adds to it (None for the first).
        Returns what this layer adds: its MLP's output."""
        h = self.input_layernorm.fused(residual) if delta is None else self.input_layernorm.fused(delta, residual)
        h = self.post_attention_layernorm.fused(self.self_attn(h, ctx, rotary, cache), residual)
        out: torch.Tensor = self.mlp(h, ctx)
        return out


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.inv_freq(), max_positions)
        self.lm_head: nn.Parameter | None = (
            None if cfg.tie_word_embeddings else nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        )
        self.head_packed: torch.Tensor | None = None  # the LM head for oneDNN (pack_for_cpu)

    def forward(
        self, input_ids: torch.Tensor, ctx: StepContext, cache: KVCache, between_layers: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. ``between_layers`` runs after every
        layer: the engine's chance to run a short step of its own in the middle of this one
        (``LLMEngine.interject``). It must not touch this step's sequences or their KV blocks."""
        x = self.embed_tokens(input_ids)
        if ctx.fused:
            return self._fused(x, ctx, cache, between_layers)
        rotation = self.rotary.at(ctx.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, rotation, cache)
            if between_layers is not None:
                between_layers()
        hidden: torch.Tensor = self.norm(x)
        return hidden

    def _fused(
        self, x: torch.Tensor, ctx: StepContext, cache: KVCache, between_layers: Callable[[], None] | None
    ) -> torch.Tensor:
        """``forward`` with each layer's residual adds folded into the next norm (``ctx.fused``)."""
        delta: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            delta = layer.fused(delta, x, ctx, self.rotary, cache)
            if between_layers is not None:
                between_layers()
        return self.norm.fused(x) if delta is None else self.norm.fused(delta, x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_packed is not None:
            return cpu_gemm.linear(hidden, self.head_packed).float()
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return F.linear(hidden, head).float()

    def pack_for_cpu(self) -> bool:
        """Every dense GEMM (the projections and the LM head) through oneDNN with its weight packed
        once (``cpu_gemm``), where oneDNN computes this model's dtype; whether it did. Projections
        with FP8 weights keep their dequantising path."""
        dtype = self.embed_tokens.weight.dtype
        if self.embed_tokens.weight.device.type != "cpu" or not cpu_gemm.available(dtype):
            return False
        for _, proj in self.linear_layers():
            if proj.weight_scale is None:
                proj.packed = cpu_gemm.pack(proj.weight)
        self.head_packed = cpu_gemm.pack(self.embed_tokens.weight if self.lm_head is None else self.lm_head)
        return True

    def linear_layers(self) -> list[tuple[int, LoraLinear]]:
        """(layer index, projection) for every projection an adapter can target."""
        out: list[tuple[int, LoraLinear]] = []
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            out += [
                (i, layer.self_attn.qkv_proj),
                (i, layer.self_attn.o_proj),
                (i, layer.mlp.gate_up_proj),
                (i, layer.mlp.down_proj),
            ]
        return out
