"""Slot draining, against starvation: when an adapter is loaded and waiting but every device slot
is held by adapters with running requests, one holder stops admitting new requests until its
running ones finish and the slot frees. Without it a steadily busy adapter keeps its slot for as
long as its traffic lasts and the waiting one starves (the demo showed 18 s waits with 2 slots
and 3 busy adapters). One drain at a time; the victim is chosen by ``drain_victim``.

Its bounds are counted in engine steps, not seconds: a step is the unit in which requests make
progress, so the same bound costs the same share of the machine whatever its speed. In seconds,
a 1 s hold was four steps on a 2-core AVX2 CPU and fifteen on a faster one, where the two
adapters sharing a slot then waited nine times their all-resident time to first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loraplane.serving.lora.entries import AdapterEntry

# A drain lasts while its waiter has requests queued. A waiter asks again whenever admission
# reaches its request, which is not every step (a full batch admits nobody); after this many steps
# without an ask the drain checks the queue, and lapses if the waiter's requests are gone (aborted),
# rather than holding the victim back for good.
DRAIN_LAPSE_STEPS = 2
# An adapter placed in a slot keeps it at least this many steps before a drain may pick it: two
# adapters sharing one slot then take turns long enough to admit their queues and produce their
# first tokens, instead of handing the slot back before their prefill is done.
SLOT_HOLD_STEPS = 2
# A drained adapter's running requests get this many steps to finish; then they are parked (out of
# the batch with their KV kept, to resume on the adapter's next turn; ``engine.scheduler``). A
# 32-token answer takes 32 steps or more inside a busy batch, and waiting for it is what made the
# demo's colder adapters wait longest.
#
# Both were 4 and 2 while a drained adapter's requests were preempted and recomputed: each turn
# then cost work, and longer turns paid it less often. Parked requests lose nothing, so turns can
# be short, and the waiter's bound (hold + this + 1 steps) falls from 7 to 4. On the demo scenario
# replayed on the step clock (benchmarks/hot_tenants_bench.py --clock steps), the colder adapters'
# worst TTFT p99 against all-resident fell to 2.5x (docs/benchmarks.md, "On the step clock").
# A victim that owes no first token, drained at the top of a step for the first request in line,
# is parked at once instead (``SlotDrain.park_now``): that request then loses no step to the turn.
DRAIN_PREEMPT_STEPS = 1
# First tokens before resumes. A waiter that owes no first token (all it wants the slot for is to
# resume parked requests, whose answers are already streaming) does not take a slot from a holder
# that owes one (a request queued for it, or admitted and not yet through its prompt), for at most
# this many steps since it began asking: a turn's length (hold, park, place). Without it the two
# adapters sharing a slot handed it back and forth every three steps for their parked decodes, and
# a new request arriving as its adapter's turn ended waited out the other's turn and its own
# adapter's next placement: the demo scenario's worst adapter at 3.9x its all-resident p99 on the
# wall clock (docs/benchmarks.md, "First tokens before resumes").
RESUME_PATIENCE_STEPS = SLOT_HOLD_STEPS + DRAIN_PREEMPT_STEPS + 1


@dataclass
class Drain:
    """``victim`` admits nothing new until its slot frees for ``waiter``."""

    victim: str
    waiter: str
    started: int  # the step it began
    asked: int  # the step the waiter last asked in; the drain lapses if it stops asking
    parks_at: int = field(init=False)  # the step the victim's running requests are parked in

    def __post_init__(self) -> None:
        self.parks_at = self.started + DRAIN_PREEMPT_STEPS  # or this step, see SlotDrain.park_now


class SlotDrain:
    def __init__(self, still_waiting: Callable[[str], bool]) -> None:
        """``still_waiting(name)``: whether ``name`` has requests queued (read only when a waiter
        has not asked for DRAIN_LAPSE_STEPS, since it counts the scheduler's queue)."""
        self.current: Drain | None = None
        self.step = 0  # engine steps so far: the clock of the drain's bounds and of slot holds
        self.still_waiting = still_waiting
        self._asking: dict[str, tuple[int, int]] = {}  # waiter -> (first, last) step it asked in, until placed

    def _live(self) -> Drain | None:
        """The current drain, unless its waiter has gone (see DRAIN_LAPSE_STEPS)."""
        d = self.current
        if d is not None and self.step - d.asked > DRAIN_LAPSE_STEPS:
            if not self.still_waiting(d.waiter):
                self.current = d = None
            else:
                d.asked = self.step
        return d

    def tick(self) -> None:
        """One engine step begins."""
        self.step += 1

    def draining(self, name: str) -> bool:
        """Whether ``name`` is the victim of a drain its waiter still asks for."""
        if self.current is None or self.current.victim != name:
            return False
        return self._live() is not None

    def ask(self, waiter: str, on_device: Callable[[str], bool], choose: Callable[[str, int], str | None]) -> None:
        """``waiter`` found every slot held: start a drain for it (``choose`` picks the victim),
        keep its drain going, or leave another waiter's drain in place."""
        now, current = self.step, self._live()
        first, last = self._asking.get(waiter, (now, now))
        self._asking[waiter] = (first if now - last <= DRAIN_LAPSE_STEPS else now, now)
        if current is not None and current.waiter != waiter:
            return  # one drain at a time; the next waiter's turn comes after this one's
        if current is not None and current.waiter == waiter and on_device(current.victim):
            current.asked = now  # still draining for this waiter
            return
        victim = choose(waiter, now)
        self.current = Drain(victim, waiter, now, now) if victim is not None else None

    def park_now(self) -> None:
        """The drain that began this step parks its victim's requests in this step, before the
        scheduler runs, so the waiter is placed and admitted in it. For a victim that owes no
        first token: its requests are all decoding, and the step DRAIN_PREEMPT_STEPS would give
        them is one more token each, bought with a step of the waiter's first token."""
        if self.current is not None and self.current.started == self.step:
            self.current.parks_at = self.step

    def admits(self, name: str) -> bool:
        """Whether the drained ``name`` may still admit a request: only in the step its drain
        began, before its requests are parked (see ``DevicePlacement.admits``)."""
        d = self.current
        return d is not None and d.victim == name and d.started == self.step < d.parks_at

    def cancel(self) -> None:
        """The victim can no longer leave its slot (pinned, or hot, meanwhile): end the drain."""
        self.current = None

    def placed(self, name: str) -> None:
        """``name`` took a slot: a drain for it has done its work."""
        self._asking.pop(name, None)
        if self.current is not None and self.current.waiter == name:
            self.current = None

    def patient(self, waiter: str) -> bool:
        """Whether ``waiter`` has asked for a slot for fewer than RESUME_PATIENCE_STEPS steps
        (a gap of more than DRAIN_LAPSE_STEPS without an ask starts the count again)."""
        first, last = self._asking.get(waiter, (self.step, self.step))
        return self.step - last > DRAIN_LAPSE_STEPS or self.step - first < RESUME_PATIENCE_STEPS

    def overdue(self) -> str | None:
        """The victim whose running requests have held its slot for DRAIN_PREEMPT_STEPS since the
        drain began (or at once, see ``park_now``): the engine parks them (they resume on its next
        turn, from the KV they kept), so a waiter's wait is bounded by the hold and this, not by
        the victim's longest request."""
        d = self.current
        if d is None or not self.draining(d.victim) or self.step < d.parks_at:
            return None
        return d.victim


def drain_victim(
    entries: Iterable[tuple[str, AdapterEntry]],
    waiter: str,
    now: int,
    hot: frozenset[str],
    demand: Callable[[str], float],
    owing: frozenset[str] = frozenset(),
) -> str | None:
    """The slot holder to drain for ``waiter`` under demand placement: the one in least demand
    among those neither pinned, nor hot, nor placed within SLOT_HOLD_STEPS (``now`` is the
    step), nor in ``owing`` (the holders that owe a first token, when the waiter owes none and
    is still patient, see RESUME_PATIENCE_STEPS); the fewest running requests break ties (its
    slot frees soonest). None when every holder is protected: the waiter asks again next step. A
    waiter with a new request therefore gets a slot within SLOT_HOLD_STEPS plus
    DRAIN_PREEMPT_STEPS (and one to place it), one resuming parked requests within
    RESUME_PATIENCE_STEPS more, and the hot set is never their price."""
    candidates = [
        e
        for name, e in entries
        if e.slot is not None
        and not e.pinned
        and name not in hot
        and name not in owing
        and name != waiter
        and now - e.placed_step >= SLOT_HOLD_STEPS
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda e: (demand(e.spec.name), e.running)).spec.name
