"""Whether CUDA work may really be issued: a GPU is present and the engine is not being traced.

The CPU-only proofs step the engine on fake CUDA tensors (``FakeTensorMode``). Streams, events,
page-locked buffers and graph capture are real CUDA objects that fake tensors cannot stand in
for, so those paths fall back to their plain synchronous forms whenever a trace is active, also
on a machine that has a GPU (where the proofs must still check what they check on a CPU).
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode


def available(device: torch.device | None = None) -> bool:
    """A real GPU for ``device`` (any CUDA device when None), and no fake-tensor trace active."""
    if device is not None and device.type != "cuda":
        return False
    return torch.cuda.is_available() and detect_fake_mode() is None
