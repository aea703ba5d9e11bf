"""Continuous batching under a token budget, with preemption by recompute.

Each step the scheduler picks, in order: every running sequence's next tokens (one for a
decode, a chunk for an unfinished prompt), then waiting sequences while the token budget
(``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and free KV blocks allow. So
prefill and decode share one batch and a long prompt is split across steps rather than stalling
the decodes. When a running sequence needs a block and none is free, the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the front of the queue keeping
its generated tokens, to be recomputed later (often mostly from the prefix cache).

A sequence can also be *parked*: taken out of the batch with its KV blocks and tokens kept, until
``ready`` says it can run again, when it resumes where it stopped. The engine parks a drained
adapter's running requests to hand its device slot to a waiting adapter (``lora.drain``): two
adapters taking turns on one slot then pay a few idle steps per turn, where preemption made them
recompute every running answer at each turn. Parked sequences resume before anything new is
admitted, and give their blocks back first when the running ones need blocks.

With fairness on, tenants share the batch: admission is least attained service first, a tenant
below its share of ``max_num_seqs`` gets a slot by preempting the tenant furthest over its share,
and the step that admits it runs without the work of the tenants bursting (over their share with
requests queued), so its first token waits for no more than the step in flight and its own. The
step in flight is kept short too: the tenants over their share add at most ``fair_prefill_chunk``
prompt tokens to any step between them, or in its place the rest of one short prompt (at most
three chunks) of a tenant with nothing else queued. Where even that step is long (a CPU), the
engine may run such a tenant's new request between its layers (``schedule_interjection``).

Torch-free: the scheduler only moves sequences and counts blocks.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field

from loraplane.serving.engine.block_manager import BlockManager
from loraplane.serving.engine.sequence import Sequence, Status

# ``fair_prefill_chunk`` when unset, by device: on a CPU a step's length grows with every token it
# computes; on a GPU a decode step is bound by reading the weights, so a few hundred more tokens
# add little to it and a short chunk would only slow the burster down. The GPU figure is a
# starting point that has not been measured (docs/benchmarks.md); ``--fair-prefill-chunk`` sets it.
FAIR_PREFILL_CHUNK = {"cuda": 512, "cpu": 16}
# The rest of a prompt of a tenant over its share but with nothing else queued goes whole, in
# place of the step's chunk, when it is at most this many chunks: chunked, its first token would
# wait as many steps, for steps whose sum is no shorter. A burst's prompts while more are queued,
# and all but the last chunks of a long document, stay chunked; no step carries more than this
# many chunks of the over-share tenants' prompts. Measured on the CPU with 3 only
# (docs/benchmarks.md, "A short prompt goes whole").
SHORT_PROMPT_CHUNKS = 3


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        ready: Callable[[Sequence], bool] = lambda _seq: True,
        on_admit: Callable[[Sequence], None] = lambda _seq: None,
        on_preempt: Callable[[Sequence], None] = lambda _seq: None,
        fair: bool = False,
        fairness_decay: float = 0.98,
        fair_prefill_chunk: int = FAIR_PREFILL_CHUNK["cpu"],
    ) -> None:
        """``ready`` says whether a waiting sequence can run now (its adapter is in a device
        slot); sequences that are not ready wait without blocking those behind them."""
        self.blocks = blocks
        self.ready, self.on_admit, self.on_preempt = ready, on_admit, on_preempt
        # Fair admission across tenants: least attained service first. Each tenant's tokens
        # (prompt at admission, then every generated token) are counted and decay by
        # ``fairness_decay`` per step; waiting sequences are admitted lowest-count tenant first,
        # FIFO within a tenant. A tenant sending ten times its share therefore waits behind the
        # others' requests instead of filling the batch, yet nobody starves: idle tenants' counts
        # fall back towards zero. Chosen over deficit round robin because it needs no quantum
        # tuning and reacts within a step to a new tenant arriving.
        self.fair, self.decay, self.fair_prefill_chunk = fair, fairness_decay, fair_prefill_chunk
        self.served: dict[str | None, float] = {}
        self.num_fair_preemptions = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []  # out of the batch, keeping their blocks (see park_where)
        self.num_preemptions = 0
        self.num_parks = 0
        self._over_prefill = fair_prefill_chunk  # see schedule()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def _preempt(self, seq: Sequence) -> None:
        self.on_preempt(seq)  # a no-op for a parked one that gave its adapter back when it was parked
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def park_where(self, pred: Callable[[Sequence], bool], give_back_adapter: bool = True) -> int:
        """Park every running sequence ``pred`` selects: out of the batch, keeping its blocks and
        tokens, its adapter given back (``on_preempt``) so the adapter's slot can free; it resumes
        once ``ready`` says so. Without ``give_back_adapter`` it keeps its adapter's lease (the
        place in the batch is what is wanted, not the slot): its adapter version cannot change
        or leave its slot before it resumes. Returns how many."""
        chosen = [s for s in self.running if pred(s)]
        for seq in chosen:
            self.running.remove(seq)
            if give_back_adapter:
                self.on_preempt(seq)
            seq.status = Status.PARKED
            self.parked.append(seq)
        self.num_parks += len(chosen)
        return len(chosen)

    def _resume_parked(self) -> None:
        """Parked sequences whose adapter has a slot again go back into the batch, oldest first,
        before any new admission: they hold blocks, and their answers are under way. Not a
        sequence that would put its tenant over its share and fill the batch while a tenant below
        its share is first in line: fair-share preemption would take it straight back, KV and all."""
        for seq in list(self.parked):
            if len(self.running) >= self.max_num_seqs:
                return
            if len(self.running) + 1 >= self.max_num_seqs:  # this resume would fill the batch
                over = self._over_share(admitting=seq)
                if seq.tenant in over and self._first_in_line(over) is not None:
                    continue
            if seq.holds_adapter or self.ready(seq):  # one that kept its lease kept its slot
                self.parked.remove(seq)
                seq.status = Status.RUNNING
                self.on_admit(seq)
                self.running.append(seq)

    def _unpark_for_blocks(self) -> bool:
        """The running sequences need blocks and none is free: the newest parked sequence gives
        its blocks back and goes to the front of the queue, to be recomputed (a preemption)."""
        if not self.parked:
            return False
        self._preempt(self.parked.pop())
        return True

    def _back_under_cap(self) -> None:
        """An interjection may admit beside a full batch; the next step parks the newest sequences
        of the bursting tenant with the most running (else of the tenant with the most) until the
        batch is back at ``max_num_seqs``. Parked, they keep their KV and their adapter's lease,
        and resume before new admissions when a place frees that no tenant below its share is
        first in line for (where a preemption would have thrown their KV away)."""
        while len(self.running) > self.max_num_seqs:
            running, _, _ = self._shares()
            heavy = max(self._bursting(self._over_share()) or running, key=lambda t: running[t])
            victim = next(s for s in reversed(self.running) if s.tenant == heavy)
            self.park_where(lambda s, v=victim: s is v, give_back_adapter=False)  # type: ignore[misc]

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._back_under_cap()
        self._resume_parked()
        self._fair_share_preemption(batch)
        over = self._over_share()
        # A step that admits a tenant below its share carries none of the bursting tenants' work:
        # that request's first token waits for this step, so the step should be as short as if
        # the tenant were alone. The burster's sequences skip one step; they keep their blocks.
        deferred = self._bursting(over) if self._first_in_line(over) is not None else set()
        budget = self.max_num_batched_tokens
        # Prefill tokens the tenants over their share may still add to this step, all of them
        # together: chunking each of their prompts is not enough when several start at once.
        # Untouched, it may go instead to one short prompt of a tenant not bursting (``_chunk``).
        self._over_prefill = self.fair_prefill_chunk
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = 0 if seq.tenant in deferred else self._chunk(seq, budget, over)
            if n == 0:  # deferred, or its tenant's prefill share of this step is spent
                i += 1
                continue
            while not self.blocks.append_slots(seq, n):
                if self._unpark_for_blocks():
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.items.append((seq, n))
                budget -= n
                i += 1
        if batch.preempted:
            return batch
        for tenant in list(self.served):
            self.served[tenant] *= self.decay
        skipped: set[int] = set()
        spent: set[str | None] = set()  # tenants over their share once this step's chunk is spent
        # The line and the shares kept up to date admission by admission, not recomputed from
        # every waiting and running sequence for each one: a step that admits k of W waiting
        # requests cost O(k * (W + running)) Python operations (a step taking 96 prompts: a few
        # milliseconds of host time, docs/benchmarks.md). An admission moves a sequence from
        # waiting to running, so the tenants with work and their share stay what they were.
        line = _Line(self.waiting, self.served) if self.fair else None
        shares = self._shares() if self.fair else None
        while budget > 0 and len(self.running) < self.max_num_seqs:
            candidate = line.next(skipped, spent) if line is not None else self._next_waiting(skipped)
            if candidate is None:
                break
            seq = candidate
            if seq.tenant in deferred:
                break  # this step is the tenants' below their share
            if not self.ready(seq):
                skipped.add(id(seq))  # its adapter is on its way; later requests may go ahead
                continue
            if seq.awaits_token:  # preempted with its last token in flight: back once that is read
                skipped.add(id(seq))
                continue
            if self._over_prefill == 0 and seq.tenant in self._over_share(admitting=seq, shares=shares):
                spent.add(seq.tenant)  # none of its requests starts this step; other tenants' may
                continue
            if not self.blocks.allocate(seq):
                break
            self._admit(seq)
            if line is not None and shares is not None:
                line.take(seq)
                shares[0][seq.tenant] += 1
                over = self._over_share(shares=shares)  # this admission may tip its tenant over
            n = self._chunk(seq, budget, over)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def schedule_interjection(self) -> ScheduledBatch:
        """A batch to run in the middle of the step in flight (after one of its layers): the
        waiting requests of tenants below their share that ``_first_in_line`` would admit first,
        alone. Only while another tenant is over its share, and only what can run without moving
        anything else: no preemption, no parking, blocks that are free now. A full batch is no
        bar: the request is below its share, so the next step parks one of the burster's
        sequences instead (``_back_under_cap``). The step in flight keeps its sequences and
        blocks; on a CPU, where one step of a burster's decodes costs as much as a neighbour's
        whole prompt, this is what keeps that neighbour's first token from waiting for it
        (``LLMEngine.interject``)."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        while budget > 0:
            seq = self._first_in_line(self._over_share(), beyond_cap=True)
            if seq is None or not self.blocks.allocate(seq):
                break
            self._admit(seq)
            n = min(seq.num_uncomputed, budget)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def _admit(self, seq: Sequence) -> None:
        """A waiting sequence whose blocks are allocated joins the batch, its prompt charged to
        its tenant. Running before ``on_admit``: should that fail, the sequence is still owned."""
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.charge(seq, seq.num_uncomputed)
        self.on_admit(seq)

    def _shares(self) -> tuple[Counter[str | None], set[str | None], float]:
        """Running sequences per tenant, the tenants with work (running or waiting) and each
        one's fair share of the batch (``max_num_seqs`` over their number)."""
        running = Counter(s.tenant for s in self.running)
        tenants = set(running) | {s.tenant for s in self.waiting}
        return running, tenants, self.max_num_seqs / max(1, len(tenants))

    def _over_share(
        self, admitting: Sequence | None = None, shares: tuple[Counter[str | None], set[str | None], float] | None = None
    ) -> set[str | None]:
        """With fairness on, the tenants running more than their share while another tenant runs
        or waits below it; counted as if ``admitting`` were running too, when given. ``shares``
        is ``_shares()`` when the caller keeps it up to date (left unchanged here)."""
        if not self.fair:
            return set()
        running, tenants, share = shares if shares is not None else self._shares()
        if admitting is not None:
            running = running.copy()
            running[admitting.tenant] += 1
        if not any(running[t] < share for t in tenants):
            return set()
        return {t for t in tenants if running[t] > share}

    def _bursting(self, over: set[str | None]) -> set[str | None]:
        """The tenants over their share that also have requests waiting: they ask for more than
        the batch gives them. A popular tenant over its share with nothing queued is left alone,
        or every neighbour's arrival would cost the hot customer a step."""
        return over & {s.tenant for s in self.waiting}

    def _first_in_line(self, over: set[str | None], beyond_cap: bool = False) -> Sequence | None:
        """The waiting sequence admission takes first, when its tenant is below its share while
        ``over`` is not empty, it can run now and its blocks are free even before anything else
        is freed (so deferring the others can never stall the step); and the batch has a place
        for it, unless ``beyond_cap``."""
        if not over or (len(self.running) >= self.max_num_seqs and not beyond_cap):
            return None
        seq = self._next_waiting(set())
        if seq is None or seq.tenant in over or seq.awaits_token:
            return None
        running, _, share = self._shares()
        if running[seq.tenant] + 1 > share or not self.ready(seq):
            return None
        if self.blocks.blocks_needed(len(seq)) + len(self.running) > self.blocks.num_free:
            return None  # room for it and one more block for each running sequence
        return seq

    def _chunk(self, seq: Sequence, budget: int, over: set[str | None]) -> int:
        """The tokens ``seq`` computes this step. While others are below their share, the tenants
        over theirs prefill at most ``fair_prefill_chunk`` tokens per step between them: the step
        length is what every other tenant's next token waits for, so the burster's prefills, one
        long prompt or several starting together, must not set it. 0 when that share is spent.
        The exception is a tenant over its share that is not bursting (nothing queued besides
        this prompt: popular, or its parked answers just resumed): while the step's share is
        untouched, the rest of one prompt, if at most ``SHORT_PROMPT_CHUNKS`` chunks, goes whole
        in its place. Chunked, a 40-token prompt waited three steps for its first token, and on
        a shared slot was often parked halfway. The bound is on size, not on who: a burst's last
        prompt, admitted once its queue is empty, and a long prompt's last chunks qualify too.
        A tenant below its share counts even while its request cannot run yet (its adapter still
        loading): the chunk then costs the burster some prefill speed for a neighbour that
        arrives within steps."""
        if seq.held:  # its token in flight is its last (async scheduling): nothing to compute
            return 0
        n = min(seq.num_uncomputed, budget)
        prefill = n > 1 or not seq.output_token_ids  # a prompt's last token is prefill too
        if prefill and seq.tenant in over:
            if (
                self._over_prefill == self.fair_prefill_chunk  # untouched this step
                and n <= SHORT_PROMPT_CHUNKS * self.fair_prefill_chunk
                and seq.tenant not in self._bursting(over)
            ):
                self._over_prefill = 0  # the rest of a prompt whole, in place of the step's chunk
                return n
            n = min(n, self._over_prefill)
            self._over_prefill -= n
        return n

    def in_line(self) -> list[Sequence]:
        """The waiting sequences in the order admission would take them now, ready or not (with
        fairness, as ``_next_waiting`` orders them before this step's admissions charge anyone)."""
        if not self.fair:
            return list(self.waiting)
        return sorted(self.waiting, key=self._line_key)  # stable: deque order breaks ties, as below

    def adapters_owed_in_line(self) -> Iterator[str]:
        """The adapters of the waiting requests still owed their first token, in line order.
        A generator: the queue is ordered only if the caller reads it (placement does so under
        ``demand`` only, and stops at the first adapter without a slot)."""
        for seq in self.in_line():
            if seq.adapter is not None and not seq.output_token_ids:
                yield seq.adapter

    def _line_key(self, seq: Sequence) -> tuple[float, bool]:
        """A waiting sequence's place in line with fairness: its tenant's decayed service, then a
        preempted sequence (one with output) before a new one."""
        return self.served.get(seq.tenant, 0.0), not seq.output_token_ids

    def _next_waiting(self, skipped: set[int], tenants_out: Container[str | None] = ()) -> Sequence | None:
        """FIFO, or with fairness the waiting sequence of the least-served tenant (FIFO within a
        tenant, a preempted sequence first: ``in_line``'s order), passing over ``skipped``
        sequences and the waiting sequences of ``tenants_out``. For one choice; a step's
        admissions keep one ``_Line`` instead, as each admission charges its tenant."""
        if not self.fair:
            return next((q for q in self.waiting if id(q) not in skipped), None)
        return _Line(self.waiting, self.served).next(skipped, tenants_out)

    def _fair_share_preemption(self, batch: ScheduledBatch) -> None:
        """When the batch is full and a waiting tenant has fewer running sequences than its fair
        share, the newest sequence of the tenant furthest over its share is preempted (it resumes
        later, mostly from the prefix cache), so a steady tenant never waits for a burster's
        requests to finish. At most one per step, to bound the churn."""
        if not self.fair or len(self.running) < self.max_num_seqs or not self.waiting:
            return
        running, _, share = self._shares()
        # Only for a waiter that could run now: preempting the heavy tenant for a request whose
        # adapter has no slot yet would cost the heavy tenant and give nobody anything.
        if not any(running[s.tenant] + 1 <= share and self.ready(s) for s in self.waiting):
            return
        heavy = max(running, key=lambda t: running[t])
        if running[heavy] <= share:
            return
        victim = next(s for s in reversed(self.running) if s.tenant == heavy)
        self.running.remove(victim)
        self._preempt(victim)
        self.num_fair_preemptions += 1

    def charge(self, seq: Sequence, tokens: int) -> None:
        """Count ``tokens`` of work against the sequence's tenant (for fair admission)."""
        self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + tokens

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks at once, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.parked:
            self.parked.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED


class _Line:
    """The waiting sequences in ``Scheduler.in_line``'s order (fairness), for one step's
    admissions: per tenant, its preempted sequences (those with output) and then its new ones,
    each in queue order with their place in the queue, and a heap of the tenants' heads keyed
    (tenant's service, new, place). The next sequence is the heap's top: what a scan of the
    whole queue by ``_line_key`` would choose (it did, once an admission), in O(log tenants). Within
    a step a key only grows (an admission charges its tenant, a passed-over head gives way to a
    later one), so a stale entry is refreshed when it reaches the top."""

    def __init__(self, waiting: Iterable[Sequence], served: dict[str | None, float]) -> None:
        self.served = served
        self.queues: dict[str | None, tuple[deque[tuple[int, Sequence]], deque[tuple[int, Sequence]]]] = {}
        for place, seq in enumerate(waiting):
            preempted, new = self.queues.setdefault(seq.tenant, (deque(), deque()))
            (new if not seq.output_token_ids else preempted).append((place, seq))
        self.heap: list[tuple[float, bool, int, str | None]] = []
        for tenant in self.queues:
            key = self._key(tenant, set())
            if key is not None:
                self.heap.append(key)
        heapq.heapify(self.heap)

    def _key(self, tenant: str | None, skipped: set[int]) -> tuple[float, bool, int, str | None] | None:
        """The tenant's head's key, dropping ``skipped`` heads (a step never takes them back)."""
        for is_new, queue in enumerate(self.queues[tenant]):
            while queue and id(queue[0][1]) in skipped:
                queue.popleft()
            if queue:  # a tenant's preempted sequences go before its new ones
                return self.served.get(tenant, 0.0), bool(is_new), queue[0][0], tenant
        return None

    def next(self, skipped: set[int], tenants_out: Container[str | None]) -> Sequence | None:
        """The next sequence in line, passing over ``skipped`` ones and the sequences of
        ``tenants_out`` (neither comes back within the step)."""
        while self.heap:
            top = self.heap[0]
            tenant = top[3]
            key = None if tenant in tenants_out else self._key(tenant, skipped)
            if key is None:
                heapq.heappop(self.heap)
            elif key != top:
                heapq.heapreplace(self.heap, key)
            else:
                preempted, new = self.queues[tenant]
                return (new if key[1] else preempted)[0][1]
        return None

    def take(self, seq: Sequence) -> None:
        """``seq``, just returned by :meth:`next`, was admitted: off the line."""
        for queue in self.queues[seq.tenant]:
            if queue and queue[0][1] is seq:
                queue.popleft()
                return
        raise ValueError(f"request {seq.request_id} was not at the head of its tenant's line")
