"""A step's traffic between host and device: one copy in, and the declared copies out.

In: the runner builds a step's integer metadata (token ids, positions, KV slots, block tables,
adapter slots and segments) as Python lists, and :func:`to_device` sends them in one
host-to-device copy of one int32 buffer (page-locked when CUDA is present, so the copy is
asynchronous), then hands out views of it. Every layer reads those views; nothing per layer
crosses the bus.

Out: :func:`to_host` is where a step waits for the device: the sampled token ids (and the
logits rows of requests whose sampling runs on the host) come back through it. Under async
scheduling a step's token ids come back through :class:`HostCopy` instead: the copy is issued
with the step and waited for after the next step is launched. A test steps the engine on fake
CUDA tensors, where any other read-back (``.item()``, ``.tolist()``, ``int()`` of a device
tensor) raises, and counts the calls here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from loraplane.serving import cuda_runtime

Shape = tuple[int, ...]


def to_device(arrays: Sequence[tuple[Sequence[int] | np.ndarray, Shape]], device: torch.device) -> list[torch.Tensor]:
    """``[(flat values, shape)]`` as int32 tensors on ``device``, copied in one transfer. Values
    are lists or numpy arrays (a step's per-token metadata, built without a loop per token)."""
    parts = [np.asarray(values, dtype=np.int32).reshape(-1) for values, _ in arrays]
    host = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32))
    if cuda_runtime.available(device):
        host = host.pin_memory()
    buffer = host.to(device, non_blocking=True)
    out, start = [], 0
    for part, (_, shape) in zip(parts, arrays, strict=True):
        n = len(part)
        assert n == math.prod(shape), f"{n} values do not fill {shape}"
        out.append(buffer[start : start + n].view(shape))
        start += n
    return out


def float_bits(values: Sequence[float]) -> np.ndarray:
    """float32 values as int32 bit patterns, so per-row coefficients travel in :func:`to_device`'s
    one int32 copy (the device side reads them back with ``.view(torch.float32)``)."""
    return np.asarray(values, dtype=np.float32).view(np.int32)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: the step's declared synchronisation with the device."""
    return t.cpu()


class HostCopy:
    """A device tensor's copy to the host, issued now and waited for later (async scheduling).

    On a GPU the copy goes into page-locked memory behind an event recorded on the compute
    stream, so :meth:`wait` waits for this step's kernels only, not for the step launched after
    it. Elsewhere (a CPU tensor, a fake-tensor trace) :meth:`wait` is :func:`to_host`."""

    def __init__(self, t: torch.Tensor) -> None:
        self._tensor, self._event = t, None
        if cuda_runtime.available(t.device):
            self._tensor = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._tensor.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()

    def wait(self) -> torch.Tensor:
        if self._event is None:
            return to_host(self._tensor)
        self._event.synchronize()
        return self._tensor
