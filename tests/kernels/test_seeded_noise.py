"""The seeded rows' sampling noise: the Triton kernel (in Triton's interpreter, ``TRITON_INTERPRET=1``
set by the root conftest) writes what the torch reference computes, into the seeded rows alone.

The values agree to float32's last bit but for the float64 log's own last bit (numpy's in the
interpreter, torch's in the reference), which can round the other way: one ulp is allowed. A
wrong hash word, a lost high bit of a seed or a column written to the wrong row is far beyond it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplane.kernels import ops  # noqa: F401  (registers torch.ops.loraplane.*)
from loraplane.kernels.layout import SlotLayoutError
from loraplane.kernels.seeded_noise import seeded_noise_reference

# Seeds with the low word's top bit set (negative as int32) and a high word, as 64-bit seeds split.
SEEDS = [0, 42, 2**31 + 5, 2**64 - 1, 2**40 + 7]


def words(seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    s = np.asarray(seeds, dtype=np.uint64)
    lo = torch.from_numpy(s.astype(np.uint32).view(np.int32).copy())
    hi = torch.from_numpy((s >> np.uint64(32)).astype(np.uint32).view(np.int32).copy())
    return lo, hi


@pytest.mark.parametrize("vocab", [1000, 5000])  # one column block (masked) and two
def test_the_kernel_writes_the_references_noise_into_the_seeded_rows(vocab: int) -> None:
    n = 8
    rows = torch.tensor([6, 0, 3, 7, 1], dtype=torch.int32)
    lo, hi = words(SEEDS)
    position = torch.tensor([0, 3, 17, 2**20, 1], dtype=torch.int32)
    before = torch.full((n, vocab), -1.0)
    got, want = before.clone(), before.clone()
    torch.ops.loraplane.seeded_noise(got, rows, lo, hi, position, "triton")
    torch.ops.loraplane.seeded_noise(want, rows, lo, hi, position, "cpu")
    for i, row in enumerate(rows.tolist()):
        expected = seeded_noise_reference(lo[i : i + 1], hi[i : i + 1], position[i : i + 1], vocab)[0]
        torch.testing.assert_close(want[row], expected, rtol=0, atol=0)
        torch.testing.assert_close(got[row], expected, rtol=2**-23, atol=0)
    untouched = [r for r in range(n) if r not in rows.tolist()]
    assert torch.equal(got[untouched], before[untouched]), "rows without a seed keep their noise"
    assert bool((got[rows.long()] > 0).all()), "Exp(1) noise is positive, never 0"


def test_the_noise_depends_on_the_seeds_both_words_and_the_position() -> None:
    vocab = 512
    base = seeded_noise_reference(*words([7]), torch.tensor([4]), vocab)
    assert torch.equal(base, seeded_noise_reference(*words([7]), torch.tensor([4]), vocab)), "a seed repeats"
    for other in (words([8]), words([7 + 2**32])):
        assert not torch.equal(base, seeded_noise_reference(*other, torch.tensor([4]), vocab))
    assert not torch.equal(base, seeded_noise_reference(*words([7]), torch.tensor([5]), vocab))
    # Exp(1): mean and variance 1 across the vocabulary.
    many = seeded_noise_reference(*words(list(range(64))), torch.zeros(64, dtype=torch.int32), vocab)
    assert abs(float(many.mean()) - 1.0) < 0.02 and abs(float(many.var()) - 1.0) < 0.05


def test_mismatched_seed_columns_are_refused_on_meta_tensors() -> None:
    noise = torch.empty(4, 100, device="meta")
    i32 = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(SlotLayoutError, match="seeded_noise"):
        torch.ops.loraplane.seeded_noise(noise, i32, i32, i32[:2], i32, "auto")
