"""Work the engine does on the host with real values is never part of a trace.

Two kinds: reading weights from files (a file's contents are the engine's input data, and
safetensors cannot fill a fake tensor), and what the sampler does with values read back from the
device (token ids to Python ints; penalties, grammars and seeded draws on logits rows). The
CPU-only proofs of the GPU path build and step the engine under ``FakeTensorMode``, where every
tensor op would otherwise be faked; :func:`host_side` suspends the mode for such a block alone.
Outside a trace it does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch._subclasses.fake_tensor import unset_fake_temporarily


@contextmanager
def host_side() -> Iterator[None]:
    with unset_fake_temporarily():
        yield
