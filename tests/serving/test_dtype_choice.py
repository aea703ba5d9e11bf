"""``dtype: auto`` on a CPU: bfloat16 only where the CPU multiplies it in hardware.

oneDNN accepts bfloat16 on any AVX-512 CPU, converting each operand to float32 where the CPU has no
BF16 instructions; there the embedded base's decode step took twice as long as in float32, so the
choice asks the CPU's own flags, not oneDNN."""

from __future__ import annotations

import pytest
import torch

from loraplane.serving.engine.builder import resolve_dtype


def test_auto_follows_the_cpus_bf16_instructions_not_onednns_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    # A plain AVX-512 CPU: oneDNN says yes, the hardware has no BF16.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    # AMX (Sapphire Rapids and later), or AVX-512 BF16 (Cooper Lake, Zen 4): bfloat16.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    # An explicit dtype is taken as asked.
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32
