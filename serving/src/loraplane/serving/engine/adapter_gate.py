"""The scheduler's view of adapters: whether a waiting sequence's adapter is in a device slot
(placing it if it can), and holding the adapter's lease while the sequence runs. A preempted or
finished sequence gives its lease back, so an idle adapter can leave its slot."""

from __future__ import annotations

import time

from loraplane.admin_api import Tier
from loraplane.serving.engine.sequence import Sequence
from loraplane.serving.lora.manager import AdapterManager
from loraplane.serving.metrics import EngineMetrics


class AdapterGate:
    def __init__(self, adapters: AdapterManager, metrics: EngineMetrics) -> None:
        self.adapters, self.metrics = adapters, metrics

    def ready(self, seq: Sequence) -> bool:
        """Whether ``seq`` can be admitted now: its leader's prompt is cached (an ``n`` > 1
        sibling shares its blocks) and its adapter holds a device slot."""
        leader = seq.leader
        if leader is not None:
            if not leader.is_finished and leader.num_computed_tokens < len(leader.prompt_token_ids):
                return False  # its prompt's blocks are not cached yet: wait and share them
            seq.leader = None
        if seq.adapter is None:
            return True
        slot = self.adapters.ensure_device(seq.adapter)
        if slot is None:
            return False
        seq.adapter_slot, seq.adapter_key = slot, self.adapters.cache_key(seq.adapter)
        return True

    def hold(self, seq: Sequence) -> None:
        """The scheduler admitted ``seq``: it runs on the adapter version it got a lease for."""
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        if seq.adapter is not None and not seq.holds_adapter:
            seq.adapter_lease = self.adapters.acquire(seq.adapter)
            seq.holds_adapter = True
            seq.adapter_version, seq.adapter_digest = self.adapters.lease_version(seq.adapter_lease)
            if seq.arrival_tier != Tier.DEVICE and seq.num_computed_tokens == 0 and not seq.output_token_ids:
                self.metrics.observe_queue_wait(seq.adapter, seq.tenant, time.monotonic() - seq.arrival_time)

    def drop(self, seq: Sequence) -> None:
        if seq.adapter is not None and seq.holds_adapter:
            self.adapters.release(seq.adapter_lease)
            seq.holds_adapter, seq.adapter_lease = False, None
