"""Turn each sequence's logits row into its next token (and the log-probabilities it asked for).

Every sequence samples with its own generator when it gives a seed, so its output does not
depend on which other requests share the batch. Log-probabilities are those of the model's
distribution after the request's logits processors and before temperature, top-k, top-p and
min-p (vLLM's default), for the chosen token and the ``logprobs`` most likely alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplane.serving import cuda_runtime
from loraplane.serving.engine import device_sampling, transfers
from loraplane.serving.engine.penalties import apply_penalties
from loraplane.serving.engine.sequence import Sequence, TokenLogprob
from loraplane.serving.engine.structured import mask_guided
from loraplane.serving.host_side import host_side


@dataclass(frozen=True)
class SampleFailure:
    """What a sequence gets instead of a token when its row could not be sampled."""

    message: str
    code: str = "sampling_failed"


NOT_FINITE = "sampling failed: the row's logits are not finite"
NONE_ALLOWED = "every token is ruled out: allowed_token_ids, bad_words, logit_bias, min_tokens and the output format leave none"


class NoTokenAllowed(ValueError):
    """The request's own settings rule out every token: the client's error, not the engine's."""


class Sampler:
    def __init__(self, seed: int = 0, eos_ids: frozenset[int] = frozenset(), backend: str = "auto") -> None:
        self.seed = seed
        self.backend = backend  # the engine's kernel backend, for the seeded rows' noise kernel
        self.default = torch.Generator().manual_seed(seed)
        self._device_default: dict[torch.device, torch.Generator | None] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.eos_ids = eos_ids  # what min_tokens holds back
        # Async scheduling: failures of rows whose step is not read back yet, oldest first per
        # sequence (with two steps in flight one sequence can have a failure in each).
        self.deferred_failures: dict[int, list[SampleFailure]] = {}

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.default
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return gen

    def _device_generator(self, device: torch.device) -> torch.Generator | None:
        """The unseeded rows' generator on ``device``, seeded like the host's, so a run's
        unseeded draws repeat with the engine's seed on a GPU as on the CPU. None where no real
        device is there to hold one (a fake-tensor trace: the device's default stands in)."""
        if device not in self._device_default:
            if device.type == "cpu":
                self._device_default[device] = self.default
            elif cuda_runtime.available(device):
                self._device_default[device] = torch.Generator(device=device).manual_seed(self.seed)
            else:
                self._device_default[device] = None
        return self._device_default[device]

    def forget(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
        self.deferred_failures.pop(seq.seq_id, None)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None] | SampleFailure]:
        """logits [len(seqs), vocab] float32, one row per sequence. A row that cannot be sampled
        (its logits processor raised, its distribution is not one) gives a ``SampleFailure`` for
        that sequence alone: the others in the batch still get their token."""
        if logits.device.type != "cpu":
            return self._sample_from_device(logits, seqs)
        if all(_plain_greedy(s) for s in seqs):  # one argmax for the batch, not one call a row
            return [(token, None) for token in logits.argmax(dim=-1).tolist()]
        out: list[tuple[int, TokenLogprob | None] | SampleFailure] = []
        broken = self._adjust(logits, seqs)
        for row, seq in zip(logits, seqs, strict=True):
            if seq.seq_id in broken:
                out.append(broken[seq.seq_id])
                continue
            try:
                out.append(self._sample_row(row, seq))
            except NoTokenAllowed as err:
                out.append(SampleFailure(str(err), code="no_token_allowed"))
            except Exception as err:
                out.append(SampleFailure(f"sampling failed: {type(err).__name__}: {err}"))
        return out

    def choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Async scheduling: every row's token id, left where the logits are (each sequence
        ``device_sampling.deferrable``); :meth:`results` reads them once they are back."""
        if all(_plain_greedy(s) for s in seqs):
            return logits.argmax(dim=-1)
        if logits.device.type == "cpu":  # the host path's draws, so a seed gives the same tokens with the flag on or off
            codes = []
            for seq, result in zip(seqs, self.sample(logits, seqs), strict=True):
                if isinstance(result, SampleFailure):  # kept whole for ``results``, its message included
                    self._defer(seq.seq_id, result)
                    codes.append(device_sampling.NOT_FINITE)
                else:
                    codes.append(result[0])
            return torch.tensor(codes, dtype=torch.long)
        return self._choose_on_device(logits, seqs)

    def _choose_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """:meth:`choose` where the logits are (a GPU's): biases and allowed lists applied there
        first (``apply_penalties``: a deferrable row reads no output, so the token in flight is
        not needed); a row they could not be applied to gets a failure code, its message kept
        for :meth:`results`."""
        broken = self._adjust(logits, seqs) if any(s.params.penalised for s in seqs) else {}
        tokens = device_sampling.choose(logits, seqs, self._device_generator(logits.device), self.backend)
        failed = [i for i, s in enumerate(seqs) if s.seq_id in broken]
        if failed:  # a bug's path, not a request's: one more small copy
            for i in failed:
                self._defer(seqs[i].seq_id, broken[seqs[i].seq_id])
            (index,) = transfers.to_device([(failed, (len(failed),))], tokens.device)
            tokens[index.long()] = device_sampling.NOT_FINITE
        return tokens

    def results(self, tokens: list[int], seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None] | SampleFailure]:
        """What :meth:`choose`'s token ids, read back, give each of ``seqs``: its token or its failure."""
        out: list[tuple[int, TokenLogprob | None] | SampleFailure] = []
        for t, seq in zip(tokens, seqs, strict=True):
            failure = self._deferred(seq.seq_id) if t < 0 else None
            out.append((t, None) if t >= 0 else failure or _result(device_sampling.Drawn(t, None)))
        return out

    def _defer(self, seq_id: int, failure: SampleFailure) -> None:
        self.deferred_failures.setdefault(seq_id, []).append(failure)

    def _deferred(self, seq_id: int) -> SampleFailure | None:
        """The oldest failure kept for ``seq_id``: results are read in the order steps launched."""
        pending = self.deferred_failures.get(seq_id)
        if not pending:
            return None
        failure = pending.pop(0)
        if not pending:
            del self.deferred_failures[seq_id]
        return failure

    def _adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, SampleFailure]:
        """Penalties, biases, token masks and grammars applied to ``logits`` in place, wherever
        it is; the rows (by seq id) that could not be adjusted, which fail alone."""
        broken: dict[int, SampleFailure] = {}
        try:
            apply_penalties(logits, seqs, self.eos_ids)
        except Exception as err:  # a bug in the batched adjustments: only the rows that asked for them fail
            failure = SampleFailure(f"penalties failed: {type(err).__name__}: {err}")
            broken |= {s.seq_id: failure for s in seqs if s.params.penalised}
        try:
            broken |= {sid: SampleFailure(message) for sid, message in mask_guided(logits, seqs).items()}
        except Exception as err:  # as above, for the structured-output rows
            failure = SampleFailure(f"structured output failed: {err}")
            broken |= {s.seq_id: failure for s in seqs if s.params.guide is not None}
        return broken

    def _sample_from_device(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> list[tuple[int, TokenLogprob | None] | SampleFailure]:
        """Rows without logits processors are sampled on the device and only their token ids
        (and asked-for log-probabilities) come back: plain greedy ones by one argmax, the others
        through ``apply_penalties``, ``mask_guided`` and ``device_sampling.draw``. Rows with
        processors (Python callables over a row) come back whole and go through the host path.
        At most two transfers, both through ``transfers.to_host``."""
        device = [i for i, s in enumerate(seqs) if device_sampling.on_device(s)]
        rest = [i for i, s in enumerate(seqs) if not device_sampling.on_device(s)]
        out: list[tuple[int, TokenLogprob | None] | SampleFailure] = [SampleFailure("not sampled")] * len(seqs)
        if device and all(_plain_greedy(seqs[i]) for i in device):
            tokens = transfers.to_host(_rows(logits, device).argmax(dim=-1))
            with host_side():
                for i, token in zip(device, tokens.tolist(), strict=True):
                    out[i] = (token, None)
        elif device:
            rows, group = _rows(logits, device), [seqs[i] for i in device]
            broken = self._adjust(rows, group)
            drawn = device_sampling.draw(rows, group, self._device_generator(rows.device), self.backend)
            with host_side():
                for i, d in zip(device, drawn, strict=True):
                    out[i] = broken.get(seqs[i].seq_id) or _result(d)
        if rest:
            host = transfers.to_host(_rows(logits, rest))
            with host_side():
                for i, result in zip(rest, self.sample(host, [seqs[i] for i in rest]), strict=True):
                    out[i] = result
        return out

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> tuple[int, TokenLogprob | None]:
        p = seq.params
        vocab = row.numel()
        for proc in p.logits_processors:
            row = proc(list(seq.output_token_ids), row)
        # Only a request's own masks can rule out every token (the model's logits are finite), and
        # argmax would then answer token 0, silently; a plain row skips the vocabulary-wide check.
        masked = p.penalised or p.guide is not None or bool(p.logits_processors)
        if masked and not bool((row > float("-inf")).any()):
            raise NoTokenAllowed(NONE_ALLOWED)
        token = int(torch.argmax(row)) if p.greedy else self._draw(row, seq)
        if not 0 <= token < vocab:  # a processor that reshaped the row would feed the next step a bad id
            raise ValueError(f"token {token} is outside the vocabulary of {vocab}")
        logprob = None
        if p.logprobs is not None:
            lp = torch.log_softmax(row, dim=-1)
            top = torch.topk(lp, p.logprobs) if p.logprobs else None
            alts = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
            logprob = TokenLogprob(token, float(lp[token]), alts)
        return token, logprob

    def _draw(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        scaled = row / p.temperature
        if p.top_k and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, index = torch.sort(scaled, descending=True)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p. The first token always stays, said
            # outright: the mass before it is 0 only in exact arithmetic, and a top_p as small as
            # 5e-324 would otherwise drop every token.
            drop = cumulative - torch.softmax(ordered, dim=-1) >= p.top_p
            drop[0] = False
            scaled = scaled.scatter(0, index[drop], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.min_p > 0:  # after temperature, as vLLM: the most likely token always stays
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq)))


def _result(d: device_sampling.Drawn) -> tuple[int, TokenLogprob | None] | SampleFailure:
    if d.token == device_sampling.NOT_FINITE:
        return SampleFailure(NOT_FINITE)
    if d.token == device_sampling.NONE_ALLOWED:
        return SampleFailure(NONE_ALLOWED, code="no_token_allowed")
    return d.token, d.logprob


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return p.greedy and not (p.logits_processors or p.penalised or p.guide is not None or p.logprobs is not None)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """These rows of ``logits``: a view when they are consecutive (no index to copy over)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    (index,) = transfers.to_device([(rows, (len(rows),))], logits.device)
    return logits[index]
