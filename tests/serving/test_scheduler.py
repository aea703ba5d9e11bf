"""The scheduler and block manager on their own (no model): budgets, ordering, preemption and
prefix-cache bookkeeping."""

from __future__ import annotations

import random

from loraplane.serving.engine.block_manager import BlockManager
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.scheduler import Scheduler, _Line
from loraplane.serving.engine.sequence import Sequence, Status


def seq(n: int, adapter_key: str | None = None, start: int = 100) -> Sequence:
    return Sequence(
        request_id=f"r{start}-{n}",
        prompt_token_ids=list(range(start, start + n)),
        params=SamplingParams(),
        adapter_key=adapter_key,
    )


def tenant_seq(tenant: str, start: int, n: int = 8) -> Sequence:
    s = seq(n, start=start)
    s.tenant = tenant
    return s


def advance(batch) -> None:
    """What the engine does after a forward pass: count computed tokens, sample one for finished prompts."""
    for s, n in batch.items:
        s.num_computed_tokens += n
        if s.num_computed_tokens == len(s):
            s.output_token_ids.append(7)


def test_decodes_first_then_prefills_within_the_token_budget() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(6), seq(9, start=200)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [(s, n) for s, n in first.items] == [(a, 6), (b, 4)]  # b's prompt is chunked
    advance(first)
    second = sched.schedule()
    assert [(s, n) for s, n in second.items] == [(a, 1), (b, 5)]
    assert second.num_tokens <= 10


def test_max_num_seqs_holds_requests_back() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(3, start=100 * i) for i in range(1, 4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [s for s, _ in batch.items] == seqs[:2]
    assert seqs[2].status is Status.WAITING


def test_preemption_takes_the_newest_and_recomputes_it_later() -> None:
    blocks = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = seq(8), seq(8, start=300)
    sched.add(old)
    sched.add(new)
    advance(sched.schedule())  # both prompts fill all four blocks
    batch = sched.schedule()  # old needs a fifth block for its next token
    assert batch.preempted == [new]
    assert [s for s, _ in batch.items] == [old]
    assert new.status is Status.WAITING and new.num_computed_tokens == 0 and new.output_token_ids == [7]
    assert sched.waiting[0] is new
    sched.finish(old)
    again = sched.schedule()
    assert again.items == [(new, 9)]  # prompt plus its generated token, recomputed


def test_prefix_blocks_are_shared_per_adapter_key_and_survive_until_reused() -> None:
    blocks = BlockManager(8, 4)
    a = seq(10, adapter_key="tenant-a@sha256:1")
    assert blocks.allocate(a)
    a.num_computed_tokens = 10
    blocks.register_full_blocks(a)
    blocks.free(a)
    same = seq(10, adapter_key="tenant-a@sha256:1")
    assert blocks.allocate(same) and same.num_cached_tokens == 8
    blocks.free(same)
    for key in ("tenant-b@sha256:1", "tenant-a@sha256:2", None):
        other = seq(10, adapter_key=key)
        assert blocks.allocate(other) and other.num_cached_tokens == 0, key
        blocks.free(other)
    assert blocks.num_free == 8


def test_prefix_blocks_are_shared_only_within_a_cache_scope() -> None:
    blocks = BlockManager(8, 4)
    a = seq(10)
    a.cache_scope = "tenant-a"
    assert blocks.allocate(a)
    a.num_computed_tokens = 10
    blocks.register_full_blocks(a)
    blocks.free(a)
    for scope, hit in (("tenant-b", 0), (None, 0), ("tenant-a", 8)):
        other = seq(10)
        other.cache_scope = scope
        assert blocks.allocate(other) and other.num_cached_tokens == hit, scope
        blocks.free(other)


def test_allocation_fails_cleanly_when_blocks_run_out() -> None:
    blocks = BlockManager(2, 4)
    big = seq(12)
    assert not blocks.allocate(big)
    assert big.block_table == [] and blocks.num_free == 2


def test_fair_admission_puts_a_bursting_tenant_behind_a_steady_one() -> None:
    def tenant_seq(tenant: str, i: int) -> Sequence:
        s = seq(4, start=1000 * (1 + (tenant == "b")) + 10 * i)
        s.tenant = tenant
        return s

    # Each request is a 4-token prompt and two generated tokens; two fit in the batch at a time.
    for fair, expected_wait in ((True, 1), (False, 11)):
        sched = Scheduler(BlockManager(256, 4), max_num_seqs=2, max_num_batched_tokens=100, fair=fair)
        for i in range(10):
            sched.add(tenant_seq("a", i))  # a burst from tenant a
        steady = tenant_seq("b", 0)
        sched.add(steady)
        steps = 0
        while steady.status is Status.WAITING:
            batch = sched.schedule()
            advance(batch)
            for s, _ in batch.items:
                if len(s.output_token_ids) >= 2:
                    sched.finish(s)  # two tokens each, then done
            steps += 1
        assert steps == expected_wait, (fair, steps)


def test_fair_share_preemption_makes_room_for_a_tenant_below_its_share() -> None:
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=2, max_num_batched_tokens=100, fair=True)
    a0, a1 = seq(4, start=100), seq(4, start=200)
    a0.tenant = a1.tenant = "a"
    sched.add(a0)
    sched.add(a1)
    advance(sched.schedule())  # tenant a fills the batch
    b = seq(4, start=300)
    b.tenant = "b"
    sched.add(b)
    batch = sched.schedule()
    assert b in [s for s, _ in batch.items]  # admitted in the very next step
    assert a1.status is Status.WAITING and a1.num_computed_tokens == 0 and a1.output_token_ids == [7]
    assert sched.num_fair_preemptions == 1
    assert [s for s, _ in batch.items if s.tenant == "a"] == [a0]


def test_a_tenant_over_its_share_prefills_in_short_chunks_while_another_is_below() -> None:
    """The step's length is what the steady tenant's next token waits for: beyond its share (here
    3 of 6 sequences) the burster's prompts go in chunks of ``fair_prefill_chunk`` tokens per step
    between them, however many start at once; the steady tenant's prompt goes whole, and with
    nobody else around nothing is chunked."""

    def tenant_seq(tenant: str, n: int, start: int) -> Sequence:
        s = seq(n, start=start)
        s.tenant = tenant
        return s

    for fair, tenants, a_chunks in ((True, "ab", [16, 40, 40, 40]), (False, "ab", [40] * 5), (True, "a", [40] * 5)):
        sched = Scheduler(BlockManager(256, 4), max_num_seqs=6, max_num_batched_tokens=500, fair=fair, fair_prefill_chunk=16)
        bursts = [tenant_seq("a", 40, 1000 * (i + 1)) for i in range(5)]
        for s in bursts:
            sched.add(s)
        if "b" in tenants:
            steady = tenant_seq("b", 40, 9000)
            sched.add(steady)
        step = sched.schedule()
        batch = dict(step.items)
        assert sorted(batch[s] for s in bursts if s in batch) == a_chunks, (fair, tenants)
        if "b" in tenants:
            assert batch[steady] == 40
        if fair and "b" in tenants:
            # The fourth prompt's next chunk takes this step's share; the fifth starts in the
            # step after, with what the fourth leaves of it.
            assert bursts[4].status is Status.WAITING
            advance(step)
            second = sched.schedule()
            assert dict(second.items).get(bursts[3]) == 16 and bursts[4].status is Status.WAITING
            advance(second)
            chunks = dict(sched.schedule().items)
            assert (chunks[bursts[3]], chunks[bursts[4]]) == (8, 8)


def test_a_short_prompt_of_a_tenant_over_its_share_with_nothing_queued_goes_whole() -> None:
    """A popular tenant over its share with nothing else queued is not bursting: its next short
    prompt (at most three chunks) goes whole in place of the step's chunk, where chunking would
    make a 40-token prompt's first token wait three steps for steps no shorter in sum. A longer
    prompt starts in chunks, and so does one of a burst (the tenant has more queued)."""
    for prompt, queued, first_chunk in ((40, 0, 40), (48, 0, 48), (60, 0, 16), (40, 1, 16)):
        sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=500, fair=True, fair_prefill_chunk=16)
        for s in [*(tenant_seq("a", 1000 * (i + 1)) for i in range(5)), tenant_seq("b", 9000)]:
            sched.add(s)
        advance(sched.schedule())  # a runs 5 of 8, over its share of 4; b runs 1
        new = [tenant_seq("a", 20_000 + 1000 * i, n=prompt) for i in range(1 + queued)]
        for s in new:
            sched.add(s)
        step = dict(sched.schedule().items)
        assert step[new[0]] == first_chunk, (prompt, queued)
        if queued:
            assert new[1].status is Status.WAITING  # a place is free, but the step's chunk is spent


def test_a_whole_short_prompt_takes_the_steps_chunk_from_every_tenant_over_its_share() -> None:
    """Two popular tenants over their share, each with one short prompt and nothing else queued:
    the first goes whole and the other waits for the next step, so the step carries one short
    prompt of theirs, not two (the bound is three chunks per step between them)."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=11, max_num_batched_tokens=500, fair=True, fair_prefill_chunk=16)
    running = [*(tenant_seq(t, 1000 * (k + 1) + (500 if t == "c" else 0)) for t in "ac" for k in range(4)), tenant_seq("b", 9000)]
    for s in running:
        sched.add(s)
    for _ in range(2):  # a and c run 4 each of 11, over their share of 3.67; b runs 1; all decode
        advance(sched.schedule())
    new = [tenant_seq(t, 20_000 + 1000 * k, n=40) for k, t in enumerate("ac")]
    for s in new:
        sched.add(s)
    step = dict(sched.schedule().items)
    assert sorted(step.get(s, 0) for s in new) == [0, 40]
    assert sum(s.status is Status.WAITING for s in new) == 1  # two places are free; the chunk is not


def test_a_tenant_whose_prefill_chunk_is_spent_holds_no_other_tenant_back() -> None:
    """Tenant a's next prompt cannot start while its chunk for the step is spent, but it is the
    one fair admission reaches first (a has been served less than c): c's request behind it is
    still admitted in that step."""

    def tenant_seq(tenant: str, n: int, start: int) -> Sequence:
        s = seq(n, start=start)
        s.tenant = tenant
        return s

    sched = Scheduler(BlockManager(256, 4), max_num_seqs=6, max_num_batched_tokens=500, fair=True, fair_prefill_chunk=16)
    bursts = [tenant_seq("a", 40, 1000 * (i + 1)) for i in range(4)]
    b1, c1 = tenant_seq("b", 8, 8000), tenant_seq("c", 8, 9000)
    for s in [*bursts, b1, c1]:
        sched.add(s)
    first = sched.schedule()  # a's share is 2 of 6: its third prompt is chunked, its fourth waits
    assert dict(first.items)[bursts[2]] == 16 and bursts[3].status is Status.WAITING
    advance(first)
    sched.charge(c1, 10_000)  # c has been served far more than a
    c2 = tenant_seq("c", 8, 9100)
    sched.add(c2)
    second = dict(sched.schedule().items)
    assert second[bursts[2]] == 16 and bursts[3].status is Status.WAITING
    assert second.get(c2) == 8


def test_the_step_that_admits_a_tenant_below_its_share_carries_no_bursting_work() -> None:
    """The steady tenant's first token waits for the step that admits it: while the burster has a
    backlog, that step runs the steady tenant's prompt alone; the burster's decodes skip it
    (keeping their blocks) and resume in the next. A tenant over its share with nothing queued is
    popular, not bursting, and keeps its step."""

    for backlog in (True, False):
        sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=500, fair=True)
        bursts = [tenant_seq("a", 1000 * (i + 1)) for i in range(10 if backlog else 7)]
        for s in bursts:
            sched.add(s)
        advance(sched.schedule())  # tenant a alone: up to eight admitted and prefilled
        running = [s for s in bursts if s.status is Status.RUNNING]
        steady = tenant_seq("b", 9000)
        sched.add(steady)
        first = sched.schedule()
        running = [s for s in running if s.status is Status.RUNNING]  # one made room for b (fair-share preemption)
        assert len(running) == 7 and all(s.block_table for s in running)
        if backlog:
            assert [s for s, _ in first.items] == [steady] and first.items[0][1] == 8
            advance(first)
            second = sched.schedule()
            assert sorted(id(s) for s, _ in second.items) == sorted(id(s) for s in [*running, steady])
        else:
            assert sorted(id(s) for s, _ in first.items) == sorted(id(s) for s in [*running, steady])


def test_no_step_is_deferred_for_a_request_whose_blocks_are_not_free() -> None:
    """If the waiting tenant's prompt cannot get its blocks yet, deferring the others would run
    nothing at all: the step goes on as usual."""
    sched = Scheduler(BlockManager(11, 4), max_num_seqs=4, max_num_batched_tokens=500, fair=True)
    bursts = []
    for i in range(5):  # four run, one waits: a backlog
        s = seq(8, start=1000 * (i + 1))
        s.tenant = "a"
        bursts.append(s)
        sched.add(s)
    advance(sched.schedule())  # 8 of the 11 blocks taken
    steady = seq(24, start=9000)  # needs 6 blocks: 5 are free once one of a's makes room for it
    steady.tenant = "b"
    sched.add(steady)
    batch = sched.schedule()
    running = [s for s in bursts if s.status is Status.RUNNING]
    assert len(running) == 3 and sorted(id(s) for s, _ in batch.items) == sorted(id(s) for s in running)
    assert steady.status is Status.WAITING


def test_a_parked_sequence_keeps_its_blocks_skips_steps_and_resumes_without_recompute() -> None:
    blocks = BlockManager(16, 4)
    turn = {"a": True}
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=100, ready=lambda s: turn[s.adapter_key or "a"])
    a, b = seq(6, "a"), seq(5, "b", start=300)
    turn["b"] = True
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # both prefill
    free = blocks.num_free
    assert sched.park_where(lambda s: s.adapter_key == "a") == 1
    turn["a"] = False  # its adapter has no slot now
    for _ in range(3):
        batch = sched.schedule()
        assert [s for s, _ in batch.items] == [b]  # a skips the steps, b goes on
        advance(batch)
    assert a.status is Status.PARKED and a.num_computed_tokens == 6 and blocks.num_free <= free  # blocks kept
    turn["a"] = True
    batch = sched.schedule()
    assert (a, 1) in batch.items  # a decode: nothing recomputed
    assert sched.num_parks == 1 and sched.num_preemptions == 0 and not sched.parked


def test_parked_sequences_give_their_blocks_first_when_the_running_ones_need_them() -> None:
    blocks = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=100, ready=lambda s: s.adapter_key != "parked")
    running, parked = seq(8, "run"), seq(8, "a", start=300)
    sched.add(running)
    sched.add(parked)
    advance(sched.schedule())  # both prompts fill all four blocks
    sched.park_where(lambda s: s is parked)
    parked.adapter_key = "parked"  # and its adapter has no slot
    batch = sched.schedule()  # running needs a fifth block: the parked one gives its blocks back
    assert [s for s, _ in batch.items] == [running] and not batch.preempted
    assert parked.status is Status.WAITING and parked.num_computed_tokens == 0 and sched.waiting[0] is parked
    assert sched.num_preemptions == 1 and not sched.parked


def test_a_parked_sequence_that_finishes_frees_its_blocks() -> None:
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=100)
    s = seq(8)
    sched.add(s)
    advance(sched.schedule())
    sched.park_where(lambda _s: True)
    sched.finish(s)
    assert blocks.num_free == 8 and not sched.parked and not sched.has_work()


def test_an_interjection_admits_only_a_tenant_below_its_share_and_the_next_step_parks_the_excess() -> None:
    """Mid-step, with tenant a filling the batch and a backlog behind it, the interjection admits
    b's new request alone, even though the batch is full, and none of a's; the running sequences
    are left as they are. The step after it parks a's newest sequence (its KV kept) to bring the
    batch back to ``max_num_seqs``, and that sequence resumes first when a place frees."""

    sched = Scheduler(BlockManager(256, 4), max_num_seqs=4, max_num_batched_tokens=500, fair=True)
    bursts = [tenant_seq("a", 1000 * (i + 1)) for i in range(6)]
    for s in bursts:
        sched.add(s)
    advance(sched.schedule())
    running = [s for s in bursts if s.status is Status.RUNNING]
    assert len(running) == 4
    assert sched.schedule_interjection().items == []  # a alone: nobody is below its share
    steady = tenant_seq("b", 9000)
    sched.add(steady)
    inner = sched.schedule_interjection()
    assert inner.items == [(steady, 8)]
    assert sched.running == [*running, steady] and all(s.num_computed_tokens == 8 for s in running)
    advance(inner)
    nxt = sched.schedule()
    assert running[-1].status is Status.PARKED and running[-1].block_table  # parked with its KV
    assert dict(nxt.items) == {**{s: 1 for s in running[:-1]}, steady: 1}
    advance(nxt)
    sched.finish(running[0])
    assert running[-1] in dict(sched.schedule().items)  # back before a's waiting requests


def test_no_interjection_without_fairness_nor_for_the_tenant_over_its_share() -> None:
    """An interjection is fairness's: without it nothing is admitted mid-step, and with it the
    burster's own new request waits for the next step like the rest of its backlog."""

    for fair in (True, False):
        sched = Scheduler(BlockManager(256, 4), max_num_seqs=4, max_num_batched_tokens=500, fair=fair)
        sched.add(tenant_seq("a", 1000))
        sched.add(tenant_seq("b", 2000))
        advance(sched.schedule())
        for i in range(4):
            sched.add(tenant_seq("a", 3000 + 100 * i))
        advance(sched.schedule())  # a runs three of four places, beyond its share of two
        late_a, late_b = tenant_seq("a", 8000), tenant_seq("b", 9000)
        sched.add(late_a)
        assert sched.schedule_interjection().items == []
        sched.add(late_b)
        assert sched.schedule_interjection().items == ([(late_b, 8)] if fair else [])
        assert late_a.status is Status.WAITING


def test_the_excess_an_interjection_leaves_is_the_bursters_and_waits_for_a_place_nobody_below_its_share_needs() -> None:
    """Tenants a (bursting: a backlog) and c (popular: nothing queued) run two each in a batch of
    four; b interjects. The next step parks the burster's newest, never the popular tenant's, and
    the parked sequence keeps its adapter lease. When a place frees while a new tenant d (below
    its share) is first in line, d gets it: the parked sequence stays parked instead of resuming
    only to be preempted, KV and all, by fair-share preemption."""

    released: list[Sequence] = []
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=4, max_num_batched_tokens=500, fair=True, on_preempt=released.append)
    a = [tenant_seq("a", 1000 * (i + 1)) for i in range(4)]
    c = [tenant_seq("c", 6000), tenant_seq("c", 7000)]
    for s in [c[0], a[0], c[1], a[1], a[2], a[3]]:
        sched.add(s)
    advance(sched.schedule())
    assert sorted(s.tenant for s in sched.running) == ["a", "a", "c", "c"]
    b = tenant_seq("b", 9000)
    sched.add(b)
    advance(sched.schedule_interjection())
    advance(sched.schedule())
    newest_a = [s for s in sched.running + sched.parked if s.tenant == "a"][-1]
    assert sched.parked == [newest_a] and all(s.status is Status.RUNNING for s in c)
    assert released == []  # parked for the place, not the slot: the lease is kept
    sched.finish(c[0])
    d = tenant_seq("d", 9500)
    sched.add(d)
    batch = dict(sched.schedule().items)
    assert batch.get(d) == 8 and newest_a not in batch and newest_a.status is Status.PARKED
    assert sched.num_preemptions == 0 and sched.num_fair_preemptions == 0


def test_the_admission_line_takes_what_a_scan_of_the_whole_queue_would() -> None:
    """A step's admissions read the fair line from each tenant's head (``_Line``) instead of
    scanning every waiting request per admission. Each choice must be the first request of the
    whole queue in line order (``in_line``: least-served tenant, its preempted requests first,
    then queue order), through ties in service, requests passed over, tenants whose chunk is
    spent, and each admission charging its tenant as the step goes."""
    rng = random.Random(53)
    for trial in range(200):
        sched = Scheduler(BlockManager(8, 4), max_num_seqs=64, max_num_batched_tokens=1000, fair=True)
        tenants = ["a", "b", "c", None][: rng.randint(1, 4)]
        for i in range(rng.randint(1, 30)):
            s = tenant_seq(rng.choice(tenants), start=1000 * trial + 10 * i)  # type: ignore[arg-type]
            if rng.random() < 0.3:
                s.output_token_ids.append(7)  # preempted, with output
            sched.waiting.append(s)
        sched.served = {t: float(rng.choice([0, 5, 5, 9])) for t in tenants if rng.random() < 0.8}
        line = _Line(sched.waiting, sched.served)
        skipped: set[int] = set()
        spent: set[str | None] = set()
        while True:
            scanned = next((q for q in sched.in_line() if id(q) not in skipped and q.tenant not in spent), None)
            chosen = line.next(skipped, spent)
            assert chosen is scanned, f"trial {trial}"
            if chosen is None:
                break
            roll = rng.random()
            if roll < 0.15:
                skipped.add(id(chosen))  # passed over: its adapter is on its way
            elif roll < 0.2:
                spent.add(chosen.tenant)
            else:
                sched.waiting.remove(chosen)  # as _admit does
                line.take(chosen)
                sched.charge(chosen, rng.choice([0, 4, 8]))
