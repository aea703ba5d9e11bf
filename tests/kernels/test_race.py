"""Each row's token in one launch: the race kernel (in Triton's interpreter, ``TRITON_INTERPRET=1``
set by the root conftest) against its torch reference, on the same logits, cut-offs and noise.

Both pick the largest ``p / q`` over the kept tokens; the kernel skips the softmax's normaliser
(it cancels) and compares min-p before normalising, so the two could part only where two tokens'
scores tie to float32 rounding, which random rows do not reach. Greedy rows take the first of
equal maxima, as ``torch.argmax`` does. That the race draws each token with its probability is
``tests/serving/test_device_sampling.py``'s (against the filters written out in numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplane.kernels import ops  # noqa: F401  (registers torch.ops.loraplane.*)
from loraplane.kernels.layout import SlotLayoutError
from loraplane.kernels.race import NONE_ALLOWED, NOT_FINITE

INF = float("inf")


def tokens(
    logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor | None, min_p: torch.Tensor, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    out = {}
    for backend in ("triton", "cpu"):
        token = torch.full((logits.shape[0],), 99, dtype=torch.long)
        torch.ops.loraplane.race(logits, temperature, cut, min_p, noise, token, backend)
        out[backend] = token
    return out["triton"], out["cpu"]


@pytest.mark.parametrize("vocab", [300, 5000])  # within one column block (masked) and across three
def test_sampled_and_greedy_rows_take_the_references_tokens(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    n = 24
    logits = torch.from_numpy(rng.normal(0, 2, (n, vocab)).astype(np.float32))
    logits[3, rng.choice(vocab, vocab - 5, replace=False)] = -INF  # five tokens allowed
    temperature = torch.tensor([0.0 if i % 4 == 0 else 0.5 + 0.1 * i for i in range(n)])
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    # Cut-offs at each row's 10th value on some rows, none (-inf) on the others; min-p on a few.
    tenth = scaled.sort(dim=1, descending=True).values[:, 9]
    cut = torch.where(torch.arange(n) % 3 == 0, tenth, -INF)
    min_p = torch.tensor([0.2 if i % 5 == 1 else 0.0 for i in range(n)])
    noise = torch.empty(n, vocab).exponential_(generator=torch.Generator().manual_seed(1))
    got, want = tokens(logits, temperature, cut, min_p, noise)
    assert torch.equal(got, want), torch.stack([got, want], 1)
    got_uncut, want_uncut = tokens(logits, temperature, None, min_p, noise)
    assert torch.equal(got_uncut, want_uncut)
    assert not torch.equal(got, got_uncut), "the cut-off changes some draws"
    assert torch.equal(got[temperature == 0], logits[temperature == 0].argmax(dim=1)), "greedy rows take the argmax"
    for i in range(n):
        assert scaled[i, got[i]] >= cut[i], f"row {i} drew a token below its cut-off"
    greedy, _ = tokens(logits, torch.zeros(n), None, min_p, None)  # no row samples: no noise at all
    assert torch.equal(greedy, logits.argmax(dim=1))


def test_rows_without_a_token_get_their_failure_code_and_ties_the_first_maximum() -> None:
    logits = torch.tensor(
        [
            [0.0, 2.0, 1.0, 2.0],  # greedy: the first of the equal maxima
            [0.0, float("nan"), 1.0, 2.0],  # a NaN: not finite
            [0.0, INF, 1.0, 2.0],  # +inf: not finite
            [-INF, -INF, -INF, -INF],  # every token masked
            [-INF, -INF, 3.0, -INF],  # one token left
        ]
    )
    n = logits.shape[0]
    for temperature in (torch.zeros(n), torch.ones(n)):
        noise = torch.ones(n, 4) if temperature[0] > 0 else None
        got, want = tokens(logits, temperature, None, torch.zeros(n), noise)
        assert torch.equal(got, want)
        assert got[1:].tolist() == [NOT_FINITE, NOT_FINITE, NONE_ALLOWED, 2]
    assert got[0] == 1, "equal noise: the race's tie goes to the first of the equally likely"
    # Equal maxima a column block apart (the kernel reads 2,048 columns at a time).
    wide = torch.zeros(2, 5000)
    wide[:, [5, 2053, 4101]] = 7.0
    for temperature in (torch.zeros(2), torch.ones(2)):
        noise = torch.ones(2, 5000) if temperature[0] > 0 else None
        got, want = tokens(wide, temperature, None, torch.zeros(2), noise)
        assert got.tolist() == want.tolist() == [5, 5]


def test_rows_whose_scaled_logits_overflow_take_the_greedy_token() -> None:
    """Finite logits that overflow float32 when divided by a small temperature leave no token a
    probability; the row gets its argmax, never an index past the vocabulary."""
    logits = torch.tensor([[-3e38] * 4, [1.0, 1e35, 2.0, 3.0]])
    temperature, min_p = torch.tensor([0.5, 1e-4]), torch.tensor([0.0, 0.1])
    got, want = tokens(logits, temperature, None, min_p, torch.ones(2, 4))
    assert got.tolist() == want.tolist() == [0, 1]


def test_mismatched_shapes_are_refused_on_meta_tensors() -> None:
    logits = torch.empty(4, 100, device="meta")
    four, token = torch.empty(4, device="meta"), torch.empty(4, dtype=torch.long, device="meta")
    with pytest.raises(SlotLayoutError, match="race"):
        torch.ops.loraplane.race(logits, four, None, four, torch.empty(4, 99, device="meta"), token, "auto")
