"""Rank caps: refusal by default, truncated SVD on opt-in, with the error numpy's SVD predicts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import tiny_engine

from loraplane.adapter_format import AdapterValidationError, ErrorCode
from loraplane.serving.lora.rank_cap import truncate_pair


def test_truncation_error_matches_numpy_svd() -> None:
    rng = np.random.default_rng(0)
    # A known rank-6 update with a decaying spectrum.
    u, _ = np.linalg.qr(rng.standard_normal((40, 6)))
    v, _ = np.linalg.qr(rng.standard_normal((30, 6)))
    sigma = np.array([5.0, 3.0, 2.0, 1.0, 0.5, 0.25])
    b = torch.tensor(u * sigma, dtype=torch.float64)  # [out, r]
    a = torch.tensor(v.T, dtype=torch.float64)  # [r, in]
    (a2, b2), dropped, total = truncate_pair(a, b, 4)
    assert a2.shape == (4, 30) and b2.shape == (40, 4)
    full = (b @ a).numpy()
    s = np.linalg.svd(full, compute_uv=False)
    expected = math.sqrt((s[4:] ** 2).sum() / (s**2).sum())
    measured = np.linalg.norm(full - (b2 @ a2).numpy()) / np.linalg.norm(full)
    assert measured == pytest.approx(expected, rel=1e-9)
    assert math.sqrt(dropped / total) == pytest.approx(expected, rel=1e-9)
    # Nothing to drop: the reduction is exact.
    (a3, b3), dropped3, _ = truncate_pair(a, b, 6)
    assert dropped3 == pytest.approx(0, abs=1e-20) and np.allclose((b3 @ a3).numpy(), full)


def test_rank_over_cap_is_refused_unless_the_adapter_opts_in(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, max_lora_rank=8)
    with pytest.raises(AdapterValidationError) as err:
        engine.load_lora("mlp16", str(tiny_adapters["mlp16"]))
    assert err.value.code is ErrorCode.RANK_OVER_CAP
    info = engine.load_lora("mlp16", str(tiny_adapters["mlp16"]), allow_rank_truncation=True)
    assert info.rank == 8
    assert info.truncation_error is not None and 0 < info.truncation_error < 1
    out = engine.generate([[5, 6, 7]], None, ["mlp16"])[0]
    assert len(out.token_ids) > 0
