"""Adapter weights go host -> device on a stream of their own, and only the step that reads a
slot waits for its copy.

Writing an adapter into a slot is a few hundred copies (one per matrix of every layer and
target module) from the host tier's page-locked tensors. On the compute stream they would sit
between two steps' kernels and stall every request in the batch. On a side stream they overlap
the running step; each slot's write ends with an event, and the runner makes the compute stream
(not the host) wait on the events of the slots its step reads, so a batch that does not use the
new adapter never waits for it.

Ordering the other way matters too: a slot is rewritten only after its previous adapter has
been drained, but the last step that read it may still be running on the device when the host
moves on, so each write first waits for the compute stream's work issued so far.

Off CUDA (or on fake CUDA tensors, where no stream exists) writes are plain synchronous copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from loraplane.serving import cuda_runtime


class SlotWrites:
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if cuda_runtime.available(device) else None  # type: ignore[no-untyped-call]
        # slot -> (the copy's event, the host tensors it reads, kept alive until a step waits on it)
        self.pending: dict[int, tuple[torch.cuda.Event, object]] = {}

    @contextmanager
    def writing(self, slot: int, sources: object) -> Iterator[None]:
        """Issue the copies made inside the block on the side stream, and record ``slot``'s event."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        self.pending[slot] = (event, sources)

    def wait(self, slots: Iterable[int]) -> None:
        """The compute stream waits, on the device, for the writes of these slots."""
        if self.stream is None or not self.pending:
            return
        current = torch.cuda.current_stream(self.stream.device)
        for slot in slots:
            entry = self.pending.pop(slot, None)
            if entry is not None:
                current.wait_event(entry[0])
