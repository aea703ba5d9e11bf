"""Placement that follows demand: the hot adapter keeps its slot, a waiter's wait is bounded.

The bounds are counted in engine steps (a slot holder keeps its slot SLOT_HOLD_STEPS, a drained
holder's requests leave the batch after DRAIN_PREEMPT_STEPS), so these tests run with the defaults
a server runs with and the behaviour shows in a handful of steps of the tiny model. A drained
holder's requests are parked, not preempted: they keep their KV and resume on its next turn.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_helpers import tiny_engine

from loraplane.admin_api import Tier
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.lora import demand, drain
from loraplane.serving.lora.entries import AdapterSpec

PROMPT = [5, 6, 7, 8]


@pytest.fixture
def no_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot set forms on the first requests (a server waits for HOT_SET_MIN decayed ones)."""
    monkeypatch.setattr(demand, "HOT_SET_MIN", 1.0)


def swaps(engine, name: str) -> int:  # type: ignore[no-untyped-def]
    """Host -> device placements of ``name`` so far."""
    return engine.metrics.counts[name].load_seconds.get("host", [0, 0.0])[0]


def test_the_hot_adapter_keeps_its_slot_while_two_colder_ones_share_the_other(
    tiny_llama, tiny_adapters, tmp_path, no_hold
) -> None:
    """Two slots, three adapters that always have work: qv4 gets three requests for every one of
    all8's and mlp16's. qv4 is placed once and never drained or evicted; the other two take turns
    in the second slot, and both are served."""
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2, max_cpu_loras=3, max_num_seqs=8)
    for name in ("qv4", "all8", "mlp16"):
        engine.load_lora(name, str(tiny_adapters[name]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    finished = {"qv4": 0, "all8": 0, "mlp16": 0}
    owner: dict[str, str] = {}
    for step in range(120):
        if step % 2 == 0:
            for name in ("qv4", "qv4", "qv4", "all8" if step % 4 == 0 else "mlp16"):
                owner[engine.add_request(PROMPT, params, adapter=name, tenant=name)] = name
        for out in engine.step():
            if out.finished:
                finished[owner[out.request_id]] += 1
    assert engine.adapters.hot_set() == {"qv4"}
    assert swaps(engine, "qv4") == 1, "the hot adapter lost its slot"
    assert swaps(engine, "all8") > 1 and swaps(engine, "mlp16") > 1  # they shared the other slot
    assert min(finished.values()) > 0, finished


def test_a_waiter_is_served_without_waiting_for_the_holders_long_requests(tiny_llama, tiny_adapters, tmp_path, no_hold) -> None:
    """One slot held by qv4, whose two running requests want 120 tokens each; all8 arrives. The
    drain parks qv4's requests instead of waiting 120 steps for them, all8 gets its first token
    in the first step after it arrives, and qv4's requests then resume from the KV they kept (nothing is recomputed) and
    finish with exactly the tokens they would have had alone."""
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    alone = tiny_engine(tiny_llama, tmp_path / "alone", max_loras=1, max_cpu_loras=2)
    alone.load_lora("qv4", str(tiny_adapters["qv4"]))
    expected = alone.generate([PROMPT, PROMPT[:3]], long, ["qv4", "qv4"])

    engine = tiny_engine(tiny_llama, tmp_path / "shared", max_loras=1, max_cpu_loras=2)
    for name in ("qv4", "all8"):
        engine.load_lora(name, str(tiny_adapters[name]))
    first = engine.add_request(PROMPT, long, adapter="qv4")
    second = engine.add_request(PROMPT[:3], long, adapter="qv4")
    for _ in range(5):
        engine.step()
    waiter = engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapter="all8")
    done: dict[str, tuple[int, list[int]]] = {}
    first_token: dict[str, int] = {}
    step = 0
    while engine.has_unfinished() and step < 600:
        for out in engine.step():
            if out.token_ids:
                first_token.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = (step, out.token_ids)
        step += 1
    # The holder was placed long enough ago and owes no first token (its requests are decoding):
    # the drain begins at the top of the first step after all8 arrives, parks qv4's requests at
    # once, and all8 takes the slot and prefills in that same step, as if it had been resident.
    # (Its remaining tokens may then wait for a turn of qv4's: the two take turns.)
    waited = first_token[waiter]
    assert waited == 0, f"all8's first token waited {waited} extra steps for its turn on qv4's slot"
    assert waiter in done
    assert engine.scheduler.num_parks >= 2 and engine.scheduler.num_preemptions == 0
    assert done[first][1] == expected[0].token_ids
    assert done[second][1] == expected[1].token_ids


def test_the_first_request_in_line_that_needs_a_slot_takes_it_at_the_top_of_the_step(tiny_llama, tiny_adapters, tmp_path) -> None:
    """One slot, held past its hold by qv4, whose answer is decoding. Requests for the base and
    for all8 arrive together, the base's first in line: all8 does not need to be at the head for
    the slot to be handed over at the top of the step, and both get their first token in it."""
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=1, max_cpu_loras=2)
    for name in ("qv4", "all8"):
        engine.load_lora(name, str(tiny_adapters[name]))
    engine.add_request(PROMPT, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True), adapter="qv4")
    for _ in range(drain.SLOT_HOLD_STEPS + 1):
        engine.step()
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    base = engine.add_request(PROMPT, short)
    waiter = engine.add_request(PROMPT, short, adapter="all8")
    assert [s.request_id for s in engine.scheduler.in_line()] == [base, waiter]
    started = {o.request_id for o in engine.step() if o.token_ids}
    assert {base, waiter} <= started, "all8's first token waited a step for the turn on qv4's slot"
    assert engine.scheduler.num_preemptions == 0 and [s.adapter for s in engine.scheduler.parked] == ["qv4"]


def test_under_lru_the_drain_keeps_its_old_order(tiny_llama, tiny_adapters, tmp_path, no_hold) -> None:
    """``eviction_policy="lru"`` keeps the previous placement: no hot set, and no preemption of
    a drained holder's requests (they finish first)."""
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=1, max_cpu_loras=2, eviction_policy="lru")
    for name in ("qv4", "all8"):
        engine.load_lora(name, str(tiny_adapters[name]))
    for _ in range(6):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapter="qv4")
    engine.step()
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapter="all8")
    while engine.has_unfinished():
        engine.step()
    assert engine.adapters.hot_set() == frozenset()
    assert engine.scheduler.num_preemptions == 0 and engine.scheduler.num_parks == 0


def test_time_to_first_token_is_a_histogram_per_adapter(tiny_llama, tiny_adapters, tmp_path) -> None:
    from prometheus_client import generate_latest

    engine = tiny_engine(tiny_llama, tmp_path, max_loras=1)
    engine.register_lora(AdapterSpec("qv4", str(tiny_adapters["qv4"]), tenant="tenant-a"))
    engine.generate([PROMPT, PROMPT], SamplingParams(max_tokens=3, temperature=0), ["qv4", None])
    text = generate_latest(engine.metrics.registry).decode()
    assert 'loraplane_time_to_first_token_seconds_count{adapter="qv4",tenant="tenant-a"} 1.0' in text
    assert 'loraplane_time_to_first_token_seconds_count{adapter="__base__",tenant="__base__"} 1.0' in text


def test_a_drain_counts_its_bounds_in_engine_steps_whatever_a_step_lasts() -> None:
    """The hold and the preemption delay are engine steps: a holder placed fewer than
    SLOT_HOLD_STEPS steps ago is never the victim, and a drained holder's requests become overdue
    exactly DRAIN_PREEMPT_STEPS steps after its drain began, however long those steps took (in
    seconds, the same bound was four steps on one CPU and fifteen on another). The drain lasts
    while its waiter has requests queued, asked or not (a full batch admits nobody, so the waiter
    does not ask every step), and lapses once they are gone."""
    from types import SimpleNamespace

    queued = {"waiter"}
    slots = drain.SlotDrain(lambda name: name in queued)
    holder = SimpleNamespace(slot=0, pinned=False, placed_step=0, running=2, spec=SimpleNamespace(name="held"))

    def choose(waiter: str, now: int) -> str | None:
        return drain.drain_victim([("held", holder)], waiter, now, frozenset(), lambda _n: 1.0)  # type: ignore[list-item]

    for _ in range(drain.SLOT_HOLD_STEPS - 1):
        slots.tick()
        slots.ask("waiter", lambda _n: True, choose)
        assert slots.current is None, "a holder inside its hold was drained"
    slots.tick()
    slots.ask("waiter", lambda _n: True, choose)
    assert slots.current is not None and slots.current.victim == "held"
    for _ in range(drain.DRAIN_PREEMPT_STEPS - 1):
        assert slots.overdue() is None
        slots.tick()
        slots.ask("waiter", lambda _n: True, choose)
    assert slots.overdue() is None
    slots.tick()
    assert slots.overdue() == "held"
    # Steps in which the waiter does not ask (the batch was full) keep the drain while it waits.
    for _ in range(3 * drain.DRAIN_LAPSE_STEPS):
        slots.tick()
    assert slots.draining("held")
    # Its requests gone (aborted), the drain lapses and the victim admits again.
    queued.clear()
    for _ in range(drain.DRAIN_LAPSE_STEPS + 1):
        slots.tick()
    assert not slots.draining("held") and slots.current is None


def test_a_queued_requests_adapter_takes_its_slot_before_its_turn(tiny_llama, tiny_adapters, tmp_path) -> None:
    """One request at a time (``max_num_seqs=1``), two slots: qv4's request runs while all8's and
    mlp16's wait. all8 takes the free slot in the first step it waits through, its copy issued
    ahead of that step's forward pass (beside it, on a GPU's side stream) instead of in the step
    that admits it; mlp16 finds no slot a prefetch may take (all8 is idle but queued for, qv4 is
    running), so it does not push all8 out. Both answers are the ones they get alone."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = tiny_engine(tiny_llama, tmp_path / "alone", max_loras=2, max_cpu_loras=3)
    for name in ("all8", "mlp16"):
        alone.load_lora(name, str(tiny_adapters[name]))
    expected = [o.token_ids for o in alone.generate([PROMPT, PROMPT], params, ["all8", "mlp16"])]

    engine = tiny_engine(tiny_llama, tmp_path / "queued", max_loras=2, max_cpu_loras=3, max_num_seqs=1)
    for name in ("qv4", "all8", "mlp16"):
        engine.load_lora(name, str(tiny_adapters[name]))
    engine.add_request(PROMPT, params, adapter="qv4")
    ids = [engine.add_request(PROMPT, params, adapter=name) for name in ("all8", "mlp16")]
    engine.step()
    engine.step()
    waiting = {s.adapter: s for s in engine.scheduler.waiting}
    assert set(waiting) == {"all8", "mlp16"}, "qv4's request still runs; both wait"
    assert engine.adapters.residency("all8") is Tier.DEVICE, "all8 waited without its copy being started"
    assert engine.adapters.residency("mlp16") is Tier.HOST
    assert engine.adapters.device_prefetches == 1
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == expected
    assert swaps(engine, "all8") == 1, "all8 was placed again after its prefetch"


@pytest.mark.parametrize("how", ["pinned", "hot"])
def test_a_drain_whose_victim_is_protected_meanwhile_turns_to_a_holder_that_can_leave(
    tiny_llama, tiny_adapters, tmp_path, how: str
) -> None:
    """Two slots held by qv4 and all8, each running a long request; mlp16 arrives, and so does a
    new request for each holder (a victim owed a first token is parked a step after its drain
    begins, not at once: the window in which this can happen). A drain picks one of them. That
    one is then pinned by the operator, or joins the engine's hot set as
    its traffic grows. Neither leaves its slot, so the drain must turn to the other holder: mlp16
    is served within the drain's bound, and the protected adapter's request is not left parked
    behind a slot that can never free. Before, the victim admitted nothing and its requests
    stayed parked until the other holder's long request ended (in the demo scenario, the hot
    customer waited ten seconds that way)."""
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2, max_cpu_loras=3)
    for name in ("qv4", "all8", "mlp16"):
        engine.load_lora(name, str(tiny_adapters[name]))
    holders = {engine.add_request(PROMPT, long, adapter=name): name for name in ("qv4", "all8")}
    for _ in range(drain.SLOT_HOLD_STEPS + 1):
        engine.step()
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    waiter = engine.add_request(PROMPT, short, adapter="mlp16")
    for name in ("qv4", "all8"):
        engine.add_request(PROMPT[:3], short, adapter=name)
    engine.step()
    current = engine.adapters.placement.drain.current
    assert current is not None and current.waiter == "mlp16"
    if how == "pinned":
        engine.pin_lora(current.victim)
    else:  # its demand overtook the hot adapter's (the hot set holds one adapter with two slots)
        engine.adapters.placement.hot_set = lambda victim=current.victim: frozenset({victim})
    protected_request = next(rid for rid, name in holders.items() if name == current.victim)
    step, finished_at = 0, None
    while finished_at is None and step < 200:
        step += 1
        if any(o.finished for o in engine.step() if o.request_id == waiter):
            finished_at = step
        if step > drain.DRAIN_PREEMPT_STEPS + 1:
            assert protected_request not in {s.request_id for s in engine.scheduler.parked}, f"{current.victim} left parked"
    bound = drain.SLOT_HOLD_STEPS + drain.DRAIN_PREEMPT_STEPS + 1 + 4
    assert finished_at is not None and finished_at <= bound, f"mlp16 waited {finished_at} steps (bound {bound})"


def _sharing_one_slot(tiny_llama, tiny_adapters, tmp_path):  # type: ignore[no-untyped-def]
    """One slot, qv4 and all8 each running a long request, stepped until a drain has just begun
    against the holder for the other, which wants the slot only to resume its parked request."""
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=1, max_cpu_loras=2)
    for name in ("qv4", "all8"):
        engine.load_lora(name, str(tiny_adapters[name]))
        engine.add_request(PROMPT, long, adapter=name, tenant=name)
    for _ in range(40):
        engine.step()
        current = engine.adapters.placement.drain.current
        if current is not None and engine.scheduler.parked and not engine.scheduler.waiting:
            return engine, current.victim, current.waiter
    raise AssertionError("the two adapters never took turns")


def steps_until_placed(engine, name: str, before_each: Callable[[], object], limit: int = 30) -> int | None:  # type: ignore[no-untyped-def]
    """Steps (``before_each`` running before every one) until ``name`` holds a slot; None if not within ``limit``."""
    for step in range(1, limit + 1):
        before_each()
        engine.step()
        if engine.adapters.residency(name) is Tier.DEVICE:
            return step
    return None


def test_a_new_request_for_the_adapter_whose_turn_is_ending_is_not_sent_to_the_back(tiny_llama, tiny_adapters, tmp_path) -> None:
    """A request arrives for the slot holder just as a drain began against it for an adapter that
    only resumes parked requests. It is served in the next step, instead of waiting for its
    adapter's requests to be parked, the other's whole turn and its adapter's next placement (in
    the demo scenario, the worst adapter's p99 at 3.9x its all-resident one); the waiter then
    gets its turn once that first token is out."""
    engine, holder, waiter = _sharing_one_slot(tiny_llama, tiny_adapters, tmp_path)
    new = engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapter=holder, tenant=holder)
    outs = engine.step()
    assert any(o.request_id == new and o.token_ids for o in outs), "the holder's new request waited for the other's turn"
    resumed_at = steps_until_placed(engine, waiter, lambda: None)
    bound = drain.SLOT_HOLD_STEPS + drain.DRAIN_PREEMPT_STEPS + 1
    assert resumed_at is not None and resumed_at <= bound, f"{waiter} waited {resumed_at} steps for its turn (bound {bound})"


def test_parked_requests_get_their_turn_however_many_new_requests_the_holder_gets(tiny_llama, tiny_adapters, tmp_path) -> None:
    """First tokens go before resumes for RESUME_PATIENCE_STEPS only: a holder that gets a new
    request every step does not keep the slot from the other adapter's parked request for good."""
    engine, holder, waiter = _sharing_one_slot(tiny_llama, tiny_adapters, tmp_path)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    placed_at = steps_until_placed(engine, waiter, lambda: engine.add_request(PROMPT, short, adapter=holder, tenant=holder))
    bound = drain.RESUME_PATIENCE_STEPS + drain.DRAIN_PREEMPT_STEPS + 2
    assert placed_at is not None and placed_at <= bound, f"{waiter}'s parked request waited {placed_at} steps (bound {bound})"


def test_a_request_queued_for_the_victim_as_its_drain_begins_gets_its_first_token_before_the_turn_passes(
    tiny_llama, tiny_adapters, tmp_path
) -> None:
    """One slot, held by qv4 (running a long answer) past its hold; all8 and qv4 each get a new
    request before the same step. That step drains qv4 for all8, and admits qv4's request all the
    same: it runs its prompt in that step and is parked with the rest in the next. Held back, it
    would have waited for all8's whole turn before its first token."""
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=1, max_cpu_loras=2)
    for name in ("qv4", "all8"):
        engine.load_lora(name, str(tiny_adapters[name]))
    engine.add_request(PROMPT, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True), adapter="qv4", tenant="qv4")
    for _ in range(drain.SLOT_HOLD_STEPS + 1):
        engine.step()
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(PROMPT, short, adapter="all8", tenant="all8")
    late = engine.add_request(PROMPT[:3], short, adapter="qv4", tenant="qv4")
    outs = engine.step()
    current = engine.adapters.placement.drain.current
    assert current is not None and (current.victim, current.waiter) == ("qv4", "all8")
    assert any(o.request_id == late and o.token_ids for o in outs), "qv4's new request waited for all8's turn"
    engine.step()
    assert engine.adapters.residency("all8") is Tier.DEVICE, "the waiter's turn came later than before"
