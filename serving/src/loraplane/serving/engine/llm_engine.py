"""The engine: one resident base model, many adapters, one continuous batch.

``add_request`` queues a prompt under an adapter (or none); each ``step`` schedules, runs one
forward pass for every scheduled token of every sequence, samples, and reports what changed.
``generate`` drives steps until the given prompts finish, for scripts and tests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial

import torch

from loraplane.adapter_format.golden import DriftLimits, DriftReport
from loraplane.admin_api import Tier
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine import adapter_admission
from loraplane.serving.engine.adapter_gate import AdapterGate
from loraplane.serving.engine.block_manager import BlockManager
from loraplane.serving.engine.detokenizer import Detokenizer
from loraplane.serving.engine.device_sampling import deferrable
from loraplane.serving.engine.model_runner import Feed, ModelRunner
from loraplane.serving.engine.outputs import RequestOutput, output_of
from loraplane.serving.engine.sampler import SampleFailure, Sampler
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.scheduler import Scheduler
from loraplane.serving.engine.sequence import PENDING, FinishReason, Sequence, TokenLogprob
from loraplane.serving.engine.step_trace import StepTrace
from loraplane.serving.engine.structured import Grammars
from loraplane.serving.engine.structured import advance as advance_grammar
from loraplane.serving.engine.transfers import HostCopy
from loraplane.serving.lora.entries import AdapterBusy, AdapterInfo, AdapterSpec
from loraplane.serving.lora.manager import AdapterManager
from loraplane.serving.lora.slot_table import SlotTable
from loraplane.serving.metrics import EngineMetrics
from loraplane.serving.model.attention import KVCache
from loraplane.serving.model.llama import LlamaModel
from loraplane.serving.tokenizer import Tokenizer
from loraplane.serving.weights.base import BaseCheckpoint

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses before queueing it (the server maps this to a 400)."""


class ContextLengthExceeded(RequestError):
    """The prompt and ``max_tokens`` together exceed the model's context (OpenAI's
    ``context_length_exceeded``)."""


@dataclass
class EngineParts:
    """What ``build_engine`` assembles from a config; the engine only steps them."""

    config: EngineConfig
    base: BaseCheckpoint
    max_model_len: int
    dtype: torch.dtype
    model: LlamaModel
    tokenizer: Tokenizer
    cache: KVCache
    blocks: BlockManager
    slots: SlotTable
    metrics: EngineMetrics
    adapters: AdapterManager
    gate: AdapterGate
    scheduler: Scheduler
    eos_ids: frozenset[int]
    sampler: Sampler
    grammars: Grammars
    runner: ModelRunner
    interjects: bool = False


@dataclass
class InFlight:
    """A step launched under async scheduling and not read back yet: what it ran, which
    sequences it sampled (each holding a ``PENDING`` token at ``places[seq_id]`` of its output),
    and their token ids on their way to the host."""

    items: list[tuple[Sequence, int]]
    sampled: list[Sequence]
    tokens: torch.Tensor | None  # on the device, in ``sampled``'s order; the next step's feed
    copy: HostCopy | None
    places: dict[int, int]
    start: float
    fresh: list[Sequence]  # for the step trace: the sequences it samples a first token for
    prompts: list[int]

    def feed(self) -> Feed | None:
        if self.tokens is None:
            return None
        return Feed(self.tokens, {seq.seq_id: i for i, seq in enumerate(self.sampled)})


class LLMEngine:
    def __init__(self, parts: EngineParts) -> None:
        """Built by ``engine.builder.build_engine``; the parts are public attributes."""
        self.config, self.base, self.max_model_len, self.dtype = parts.config, parts.base, parts.max_model_len, parts.dtype
        self.model, self.tokenizer, self.cache, self.blocks = parts.model, parts.tokenizer, parts.cache, parts.blocks
        self.slots, self.metrics, self.adapters, self.scheduler = parts.slots, parts.metrics, parts.adapters, parts.scheduler
        self.eos_ids, self.sampler, self.grammars, self.runner = parts.eos_ids, parts.sampler, parts.grammars, parts.runner
        self.gate = parts.gate
        self.requests: dict[str, Sequence] = {}
        # Whether a step may run another between its layers (``interject``): the builder's
        # choice, from ``EngineConfig.fair_interjection``.
        self.interjects = parts.interjects
        self.num_interjections = 0
        # Set by whoever drives the steps and takes requests meanwhile (the server's engine loop,
        # a replay): it adds what arrived and calls ``interject``, delivering what that returns.
        self.between_layers: Callable[[], None] | None = None
        self.ran = False  # whether the last step ran a batch (an idle one lets its caller sleep)
        self._ids = itertools.count()
        self.trace = StepTrace(self.config.step_trace) if self.config.step_trace is not None else None
        # Async scheduling (``EngineConfig.async_scheduling``): the step launched and not read back.
        self.in_flight: InFlight | None = None

    # adapters (vLLM's add_lora / pin_lora / remove_lora family) ------------------------------
    def register_lora(self, spec: AdapterSpec) -> None:
        """Declare an adapter by name and source; it loads in the background on first use."""
        self.adapters.register(spec)

    def load_lora(
        self,
        name: str,
        source: str,
        *,
        expected_digest: str | None = None,
        tenant: str | None = None,
        allow_rank_truncation: bool = False,
    ) -> AdapterInfo:
        """Load into host memory now and register (see ``adapter_admission.load_lora``)."""
        spec = AdapterSpec(name, source, expected_digest, tenant, allow_rank_truncation)
        return adapter_admission.load_lora(self, spec)

    def verify_golden(self, name: str, limits: DriftLimits | None = None) -> DriftReport | None:
        return adapter_admission.verify_golden(self, name, limits)

    def pin_lora(self, name: str) -> None:
        """Keep the adapter resident (loading it now if cold); it is never evicted until unpinned."""
        self.adapters.pin(name)

    def unpin_lora(self, name: str) -> None:
        self.adapters.unpin(name)

    def prefetch_lora(self, name: str) -> None:
        """Start bringing the adapter into host memory, off the request path."""
        self.adapters.prefetch(name)

    def unload_lora(self, name: str) -> None:
        # A parked request is queued too: it resumes on this adapter once it has a slot again.
        waiting = sum(1 for s in (*self.scheduler.waiting, *self.scheduler.parked) if s.adapter == name)
        if waiting:
            raise AdapterBusy(f"adapter {name!r} has {waiting} queued requests")
        self.adapters.unregister(name)

    # requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
        after: str | None = None,
        cache_scope: str | None = None,
    ) -> str:
        """Queue a request. ``after`` names a request with the same prompt (another sample of an
        ``n`` > 1 call): this one waits until that one's prompt is in the KV cache and then shares
        its blocks through the prefix cache instead of computing the prompt again. Only requests
        of one ``cache_scope`` share cached prompt blocks (the server scopes them by tenant)."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.base.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        named = (
            *(t for t, _ in params.logit_bias), *params.stop_token_ids, *params.allowed_token_ids,
            *(t for word in params.bad_words_token_ids for t in word),
        )  # fmt: skip
        if any(not 0 <= t < vocab for t in named):
            raise RequestError(f"logit_bias, stop_token_ids, allowed_token_ids and bad_words must name token ids in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(  # OpenAI's and vLLM's wording, which clients match on
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens."
            )
        seq = Sequence(
            request_id=request_id, prompt_token_ids=ids, params=params, adapter=adapter, tenant=tenant, cache_scope=cache_scope
        )
        decode = (
            self.tokenizer.decode if params.skip_special_tokens else partial(self.tokenizer.decode, skip_special_tokens=False)
        )
        seq.detokenizer = Detokenizer(decode, params.stop, params.include_stop_str_in_output)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(ids)
        seq.leader = self.requests.get(after) if after is not None else None
        seq.arrival_time = time.monotonic()
        if adapter is not None:
            info = self.adapters.info(adapter)  # raises AdapterNotFound for an unknown name
            self.adapters.check_available(adapter)
            seq.tenant = info.tenant or tenant
            seq.arrival_tier = {Tier.DEVICE: "device", Tier.HOST: "host"}.get(info.residency, "cold")
            self.adapters.note_arrival(adapter)
            if info.residency is not Tier.DEVICE:
                self.adapters.prefetch(adapter)  # start the load now, not when the batch has room
        self.metrics.observe_request(adapter, seq.tenant, len(ids), seq.arrival_tier)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        if self.trace is not None:
            self.trace.arrival(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        while seq.awaits_token:  # tokens in flight it will not get
            seq.output_token_ids.pop()
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.sampler.forget(seq)
        self.gate.drop(seq)
        seq.leader = None
        detok = seq.detokenizer
        if detok is None:
            return
        try:
            detok.flush()
            seq.output_text = detok.text
        except Exception as err:  # a detokeniser failure ends this request, with what it had
            seq.output_text, seq.error, seq.error_code = detok.text, f"detokenising failed: {err}", "engine_error"
            seq.finish_reason = FinishReason.ERROR

    def _check_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        early = len(seq.output_token_ids) < p.min_tokens  # vLLM: no stop of any kind before min_tokens
        if seq.detokenizer is not None:
            seq.detokenizer.push(token, find_stops=not early)
            if seq.detokenizer.stopped:
                return FinishReason.STOP
        if not early and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)):
            return FinishReason.STOP
        if seq.matcher is not None and seq.matcher.is_stopped():
            return FinishReason.STOP  # the document is complete: the grammar allows nothing more
        if len(seq.output_token_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def step(self) -> list[RequestOutput]:
        """One scheduling round and one forward pass; outputs of the sequences that advanced.
        When ``interjects``, ``between_layers`` runs after each of the forward pass's layers."""
        outputs = self._fail_loads()
        overdue = self.adapters.begin_step(self.scheduler.adapters_owed_in_line())
        if overdue is not None:  # its slot is owed to a waiting adapter (see DevicePlacement.begin_step)
            name, slot = overdue  # parked, not preempted: they resume without recompute on its next turn
            self.scheduler.park_where(lambda s: s.adapter == name and s.adapter_slot == slot)
        batch = self.scheduler.schedule()
        self.ran = bool(batch.items)
        if self.scheduler.waiting:  # before the forward pass is issued, so the copies run beside it
            self.adapters.prefetch_device(s.adapter for s in self.scheduler.waiting if s.adapter is not None)
        if not batch.items:
            if self.in_flight is not None:
                return self._resolve(outputs)
            if self.adapters.loads_in_flight():
                self.adapters.wait_for_loads(timeout=0.05)  # nothing to run until a load lands
            return outputs
        if self.config.async_scheduling:
            return self._run_async(batch.items, outputs)
        hook = self._between_layers if self.interjects and self.between_layers is not None else None
        return self._run(batch.items, outputs, hook)

    def _between_layers(self) -> None:
        """``between_layers``, kept from failing the step in flight: an error there is the new
        requests' (they stay queued, or failed by ``interject``), never the running batch's."""
        assert self.between_layers is not None
        try:
            self.between_layers()
        except Exception:
            log.exception("taking new requests inside a step failed")

    def interject(self) -> list[RequestOutput]:
        """After a layer of the step in flight: admit the waiting requests of tenants below
        their fair share (``Scheduler.schedule_interjection``) and run their first forward pass
        now, alone, before the rest of that step. Their first token then waits for one layer of
        the burster's step instead of the whole of it: on a CPU a step of a burster's decodes
        costs about what a neighbour's prompt does, and was the last thing standing between that
        neighbour's first token and its time alone (docs/benchmarks.md, "Fair admission between
        tenants"). The step in flight is untouched: its sequences and their blocks are not the
        new ones'."""
        if not self.interjects:
            return []
        batch = self.scheduler.schedule_interjection()
        if not batch.items:
            return []
        self.num_interjections += 1
        return self._run(batch.items, [], None, interjection=True)

    def _run(
        self,
        items: list[tuple[Sequence, int]],
        outputs: list[RequestOutput],
        between_layers: Callable[[], None] | None,
        *,
        interjection: bool = False,
    ) -> list[RequestOutput]:
        """One forward pass over ``items`` and what it advanced, added to ``outputs``."""
        start, trace = time.monotonic(), self.trace
        fresh = [s for s, _ in items if not s.output_token_ids] if trace is not None else []
        prompts = trace.prompt_chunks(items) if trace is not None else []
        try:
            results = self.runner.run(items) if between_layers is None else self.runner.run(items, between_layers)
        except Exception as err:  # the shared forward pass: only the batch it ran fails, the queue goes on
            log.exception("forward pass failed for %d sequences", len(items))
            if trace is not None:
                trace.step(start, items, prompts, [], interjection=interjection, failed=True)
            self._fail_pass(items, err, outputs)
            return self._forget_finished(outputs)
        generated: Counter[tuple[str | None, str | None]] = Counter()  # tokens per (adapter, tenant), counted once a step
        for seq, n in items:
            seq.num_computed_tokens += n
            self.blocks.register_full_blocks(seq)
            result = results.get(seq.seq_id)
            if result is None:
                continue
            self._advance_alone(seq, result, generated)
            outputs.append(output_of(seq))
        for (adapter, tenant), count in generated.items():
            self.metrics.observe_tokens(adapter, tenant, count)
        if trace is not None:
            firsts = [s.request_id for s in fresh if s.output_token_ids]
            trace.step(start, items, prompts, firsts, interjection=interjection)
        return self._forget_finished(outputs)

    def _run_async(self, items: list[tuple[Sequence, int]], outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Async scheduling (vLLM V1's, SGLang's overlap scheduler): launch this step, then read
        back the step before it, whose tokens this one was fed on the device. On a GPU the host's
        work for a step (scheduling, its metadata, the previous step's stop checks and text) runs
        while the device computes. A step with a row that needs the host to sample it
        (``device_sampling.deferrable``) runs synchronously, after the one in flight is read back."""
        if not all(deferrable(seq) for seq, _ in items):
            self._resolve(outputs)
            items = [(seq, n) for seq, n in items if not seq.is_finished]  # stopped by the tokens just read
            return self._run(items, outputs, None) if items else self._forget_finished(outputs)
        start, trace, previous = time.monotonic(), self.trace, self.in_flight
        prompts = trace.prompt_chunks(items) if trace is not None else []
        try:
            sampled, tokens = self.runner.launch(items, previous.feed() if previous is not None else None)
        except Exception as err:  # this step's sequences fail; the step before still delivers its tokens
            log.exception("forward pass failed for %d sequences", len(items))
            self._resolve(outputs)
            if trace is not None:
                trace.step(start, items, prompts, [], interjection=False, failed=True)
            self._fail_pass(items, err, outputs)
            return self._forget_finished(outputs)
        caching = self.blocks.enable_prefix_caching
        for seq, n in items:
            seq.num_computed_tokens += n
            if caching:
                # Its prompt blocks keyed now, not when this step is read back: a sibling sample
                # (``after``) is admitted at the next schedule and shares them; a block that
                # holds the token in flight waits for its value.
                self.blocks.register_full_blocks(seq, upto=len(seq) - 1 if seq.awaits_token else len(seq))
        places = {}
        for seq in sampled:
            places[seq.seq_id] = len(seq.output_token_ids)
            seq.output_token_ids.append(PENDING)
        self.in_flight = InFlight(
            items, sampled, tokens, HostCopy(tokens) if tokens is not None else None, places, start,
            [s for s in sampled if s.output_token_ids == [PENDING]] if trace is not None else [], prompts,
        )  # fmt: skip
        if previous is not None:
            self._deliver(previous, outputs)
            if all(seq.is_finished for seq, _ in items):  # every one stopped at the step just read: nothing to wait for
                self.in_flight = None
        return self._forget_finished(outputs)

    def _resolve(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Read back the step in flight, if any, and deliver what it advanced into ``outputs``."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            self._deliver(flight, outputs)
        return self._forget_finished(outputs)

    def _deliver(self, flight: InFlight, outputs: list[RequestOutput]) -> None:
        """``flight``'s tokens in place of their placeholders: stop checks, text, metrics, as a
        synchronous step's. A sequence already sampled again by the step launched since (one
        more ``PENDING`` behind this one) keeps that placeholder unless this token ends it; the
        token it was sampling is then discarded. Finished sequences (aborted meanwhile) are skipped."""
        try:
            tokens = flight.copy.wait().tolist() if flight.copy is not None else []
        except Exception as err:  # the device failed the step: its sequences fail, nothing else
            # Their prompt blocks keyed at launch stay keyed, though the step may not have written
            # them: on a GPU a failed step's error is sticky, and the engine does not outlive it.
            log.exception("reading back a step of %d sequences failed", len(flight.items))
            self._fail_pass(flight.items, err, outputs)
            return
        results = dict(zip((s.seq_id for s in flight.sampled), self.sampler.results(tokens, flight.sampled), strict=True))
        generated: Counter[tuple[str | None, str | None]] = Counter()
        for seq, _ in flight.items:
            if seq.is_finished:
                continue
            result = results.get(seq.seq_id)
            if result is None:  # a prompt chunk short of its last token: its blocks were keyed at launch
                outputs.append(output_of(seq))
                continue
            place = flight.places[seq.seq_id]
            ahead = len(seq.output_token_ids) - place - 1  # 1 when the next step sampled it again
            del seq.output_token_ids[place:]
            self._advance_alone(seq, result, generated)
            outputs.append(output_of(seq))
            if not seq.is_finished:
                self.blocks.register_full_blocks(seq)
                if ahead:
                    seq.output_token_ids.append(PENDING)
        for (adapter, tenant), count in generated.items():
            self.metrics.observe_tokens(adapter, tenant, count)
        if self.trace is not None:
            firsts = [s.request_id for s in flight.fresh if s.output_token_ids and s.output_token_ids[0] != PENDING]
            self.trace.step(flight.start, flight.items, flight.prompts, firsts, interjection=False)

    def _fail_pass(self, items: list[tuple[Sequence, int]], err: Exception, outputs: list[RequestOutput]) -> None:
        """A forward pass that failed fails the sequences it ran, each with one final output; not
        one that finished before (stopped by the step read just before, or aborted)."""
        for seq, _ in items:
            if not seq.is_finished:
                self._fail(seq, f"the forward pass failed: {type(err).__name__}: {err}", "engine_error")
                outputs.append(output_of(seq))

    def _advance_alone(
        self,
        seq: Sequence,
        result: tuple[int, TokenLogprob | None] | SampleFailure,
        generated: Counter[tuple[str | None, str | None]],
    ) -> None:
        """``_advance``, where an error (its stop check, its text) fails this sequence alone."""
        try:
            self._advance(seq, result, generated)
        except Exception as err:
            log.exception("request %s failed after sampling", seq.request_id)
            self._fail(seq, f"{type(err).__name__}: {err}", "engine_error")

    def _advance(
        self,
        seq: Sequence,
        result: tuple[int, TokenLogprob | None] | SampleFailure,
        generated: Counter[tuple[str | None, str | None]],
    ) -> None:
        """Append the sampled token (counted in ``generated``) and finish the sequence if it is
        done; a sampling failure finishes it with its error."""
        if isinstance(result, SampleFailure):
            self._fail(seq, result.message, result.code)
            return
        token, logprob = result
        seq.output_token_ids.append(token)
        generated[seq.adapter, seq.tenant] += 1
        if len(seq.output_token_ids) == 1:
            self.metrics.observe_ttft(seq.adapter, seq.tenant, time.monotonic() - seq.arrival_time)
        self.scheduler.charge(seq, 1)
        if logprob is not None:
            seq.logprobs.append(logprob)
        broken = advance_grammar(seq, token, self.eos_ids)
        if broken is not None:  # the token breaks the request's grammar (a logits processor overrode it)
            self._fail(seq, broken, "sampling_failed")
            return
        reason = self._check_stop(seq, token)
        if reason is not None:
            self._finish(seq, reason)

    def _fail(self, seq: Sequence, message: str, code: str) -> None:
        if not seq.is_finished:
            seq.error, seq.error_code = message, code
            self._finish(seq, FinishReason.ERROR)

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for seq in [s for s in self.requests.values() if s.is_finished]:
            del self.requests[seq.request_id]
        return outputs

    def _fail_loads(self) -> list[RequestOutput]:
        """Requests waiting for an adapter whose load failed end with its error; nothing else does."""
        failures = {f.name: f.message for f in self.adapters.poll()}
        if not failures:
            return []
        outputs = []
        for seq in [s for s in self.scheduler.waiting if s.adapter in failures]:
            self._fail(seq, failures[seq.adapter], "adapter_load_failed")  # type: ignore[index]
            del self.requests[seq.request_id]
            outputs.append(output_of(seq))
        return outputs

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion together (one continuous batch); outputs in input order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        adapter_list = adapters or [None] * len(prompts)
        ids = [self.add_request(p, sp, adapter=a) for p, sp, a in zip(prompts, params_list, adapter_list, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
