"""Each row's top-k/top-p cut-off: the Triton kernel's search (in Triton's interpreter,
``TRITON_INTERPRET=1`` set by the root conftest) against the sorted definition, and the sorted
definition against the filters written out in numpy from their definitions (OpenAI's and vLLM's:
top-k by value, top-p the smallest prefix of the order whose mass reaches p).

The search sums the mass in another order than the sort's cumulative sum, so where a prefix's
mass lies within float32 rounding of p the two could keep one token apart; the rows here keep
clear of that, and the cut-offs must then be the same value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplane.kernels import ops  # noqa: F401  (registers torch.ops.loraplane.*)
from loraplane.kernels.layout import SlotLayoutError
from loraplane.kernels.top_k_top_p import scale

VOCAB = 1000  # under one of the kernel's column blocks, masked; 5000 below spans three


def kept_by_definition(row: np.ndarray, k: int, p: float) -> np.ndarray:
    order = np.argsort(-row, kind="stable")
    z = row.astype(np.float64)
    if k < len(row):
        z = np.where(z < z[order[k - 1]], -np.inf, z)
    keep = np.isfinite(z)
    if p < 1.0:
        q = np.exp(z - z.max())
        q /= q.sum()
        before = np.cumsum(q[order]) - q[order]
        in_top_p = np.zeros_like(keep)
        in_top_p[order] = before < p
        keep &= in_top_p
    return keep


CASES = [(VOCAB, 1.0), (1, 1.0), (5, 1.0), (40, 1.0), (VOCAB, 0.9), (VOCAB, 0.3), (50, 0.95), (3, 0.5), (VOCAB, 1e-6)]


def rows_and_filters(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (len(CASES), vocab)).astype(np.float32)
    x[2, rng.choice(vocab, vocab // 2, replace=False)] = -np.inf  # a masked row (allowed_token_ids)
    top_k = torch.tensor([k for k, _ in CASES], dtype=torch.int32)
    top_p = torch.tensor([p for _, p in CASES], dtype=torch.float32)
    return torch.from_numpy(x), top_k, top_p


@pytest.mark.parametrize("vocab", [VOCAB, 5000])
def test_the_kernels_cut_off_is_the_sorted_definitions(vocab: int) -> None:
    logits, top_k, top_p = rows_and_filters(vocab)
    temperature = torch.tensor([0.7, 1.0, 0.0, 1.3] + [1.0] * (len(CASES) - 4))  # 0: a greedy row, scaled by 1
    x = scale(logits, temperature)
    got, want = torch.empty(len(CASES)), torch.empty(len(CASES))
    torch.ops.loraplane.top_k_top_p_threshold(logits, temperature, top_k, top_p, got, "triton")
    torch.ops.loraplane.top_k_top_p_threshold(logits, temperature, top_k, top_p, want, "cpu")
    masked = [x.masked_fill(x < cut.unsqueeze(1), float("-inf")) for cut in (got, want)]
    assert torch.equal(*masked), torch.stack([got, want], 1)
    for i, (k, p) in enumerate(CASES):
        keep = kept_by_definition(x[i].numpy(), k, p)
        assert np.array_equal(x[i].numpy() >= want[i].item(), keep), f"row {i}: top_k={k}, top_p={p}"


def test_ties_at_the_cut_off_stay_and_masked_rows_keep_nothing_masked() -> None:
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0], [float("-inf")] * 6, [1.0, float("-inf"), 1.0, 1.0, 1.0, 1.0]])
    top_k = torch.tensor([2, 6, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 0.1], dtype=torch.float32)
    for backend in ("triton", "cpu"):
        out = torch.empty(3)
        torch.ops.loraplane.top_k_top_p_threshold(x, torch.ones(3), top_k, top_p, out, backend)
        assert out[0].item() == 2.0, "the 2nd largest is 2.0, tied three times: all three stay"
        assert out[1].item() == float("-inf"), "a row with no token allowed has nothing to cut"
        assert out[2].item() == 1.0, "equal logits: the first's mass reaches p, its equals stay"


def test_mismatched_rows_are_refused_on_meta_tensors() -> None:
    logits = torch.empty(4, 100, device="meta")
    four, three = torch.empty(4, device="meta"), torch.empty(3, device="meta")
    with pytest.raises(SlotLayoutError, match="top_k_top_p_threshold"):
        torch.ops.loraplane.top_k_top_p_threshold(logits, four, four.int(), three, four, "auto")
