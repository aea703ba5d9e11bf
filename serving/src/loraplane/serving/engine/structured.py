"""Structured output: JSON (any object, or one matching a schema), a regular expression, a choice
among strings or a grammar, enforced token by token.

The grammar work is llguidance's (Microsoft's Rust library behind vLLM's and SGLang's
``guidance`` backend): it compiles a JSON schema (or a regular expression, or a grammar) against
the tokenizer's vocabulary and, for each sequence's state, computes the bitmask of tokens that
keep the output inside the grammar. The engine keeps one matcher per sequence, fills the masks of
every guided row of a step in one parallel call, and applies them to the batch's logits at once,
so guided and unguided requests (on any adapters) share a batch. A request's guide is compiled before it is queued, so a schema
the library refuses is the caller's 400, never a failure inside a step.

The mask is filled through ``llguidance.numpy`` and unpacked with three torch operations rather
than through ``llguidance.torch``: that module's kernel goes through ``torch.compile`` (a C
compiler and a compile on the first request), and importing it imports Triton, whose standard
library is then built outside ``TRITON_INTERPRET`` and breaks the interpreted kernels of the
CPU tests.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import torch

from loraplane.serving.engine import transfers
from loraplane.serving.engine.sequence import Sequence


class GrammarError(ValueError):
    """A response format the grammar library cannot compile."""


# What a request may constrain its output to, as vLLM's ``structured_outputs`` names them: a JSON
# schema, a regular expression, one of a list of strings, or a grammar (Lark or llama.cpp's GBNF,
# as vLLM's guidance backend takes it).
_WHAT: dict[str, str] = {"json": "the JSON schema", "regex": "the regular expression", "choice": "the choices",
                         "grammar": "the grammar"}  # fmt: skip


class Guide:
    """One compiled grammar: what a request's ``SamplingParams.guide`` holds. Its first matcher
    is built when the request is compiled (off the event loop and the engine thread); each
    sequence gets a copy of it, which costs a copy of the parser's state, not a grammar build."""

    def __init__(self, grammars: Grammars, grammar: str, what: str = _WHAT["json"]) -> None:
        self.grammars, self.grammar = grammars, grammar
        self.template = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
        if self.template.is_error():
            raise GrammarError(f"{what} cannot be compiled: {self.template.get_error()}")

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class Grammars:
    """The engine's grammar compiler. Wrapping the tokenizer costs about a second, so it is done
    once, on the first structured request."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: frozenset[int] = frozenset()) -> None:
        self.hf, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, eos_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.executor = llguidance.LLExecutor()
        # The server compiles schemas here, not on the shared default pool: two threads bound
        # how much CPU schemas take at once (llguidance's fuel bounds each compile).
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                # Every id the engine ends a sequence on (the model's config may name more than the tokenizer).
                eos = sorted(self.eos_ids) or None
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def compile(self, spec: Any = None, kind: str = "json") -> Guide:
        """A guide for output of ``kind``: documents matching the JSON schema ``spec`` (None: any
        JSON object, OpenAI's ``json_object``), text matching the regular expression ``spec``, one
        of the strings in ``spec``, or text of the grammar ``spec``."""
        what = _WHAT[kind]
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec if spec is not None else {"type": "object"}, defaults={"whitespace_flexible": False}
                )
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(spec))
            else:  # Lark, or GBNF turned into Lark
                grammar = llguidance.grammar_from("grammar", spec)
            tokenizer = self.tokenizer
        except (ValueError, TypeError) as err:  # a bad spec, or a tokenizer llguidance cannot wrap
            raise GrammarError(f"{what} cannot be compiled: {err}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise GrammarError(f"{what} cannot be compiled: {problem}")
        return Guide(self, grammar, what)


def mask_guided(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, str]:
    """Set the logits of every token a guided row's grammar forbids to -inf, in place. Returns
    the rows (by seq id) whose matcher is in an error state, with its message."""
    rows = [(i, s) for i, s in enumerate(seqs) if s.params.guide is not None]
    if not rows:
        return {}
    broken: dict[int, str] = {}
    live: list[tuple[int, Sequence]] = []
    for i, s in rows:
        if s.matcher is None:
            s.matcher = s.params.guide.matcher()
        if s.matcher.is_error():
            broken[s.seq_id] = f"structured output: {s.matcher.get_error()}"
        else:
            live.append((i, s))
    if not live:
        return broken
    grammars: Grammars = live[0][1].params.guide.grammars
    vocab = logits.shape[1]
    words = llguidance.numpy.allocate_token_bitmask(len(live), grammars.tokenizer.vocab_size)
    llguidance.numpy.fill_next_token_bitmask_par(grammars.executor, [(s.matcher, k) for k, (_, s) in enumerate(live)], words)
    # The bitmask (a bit per token, 16 KB a row at a 128k vocabulary) goes to wherever the logits
    # are, in one copy with the rows' indices, and is unpacked there: vLLM applies xgrammar's the
    # same way, so a guided row's logits never come back to the host.
    index, bitmask = transfers.to_device([([i for i, _ in live], (len(live),)), (words, words.shape)], logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1).bool()[:, :vocab]
    if allowed.shape[1] < vocab:  # the model's padding rows beyond the tokenizer's vocabulary
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = index.long()
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
    return broken


def advance(seq: Sequence, token: int, eos_ids: frozenset[int]) -> str | None:
    """Move a guided sequence's matcher past its new token; the error when the token breaks the
    grammar (a logits processor overrode the mask)."""
    m = seq.matcher
    if m is None:
        return None
    if token in eos_ids and m.is_accepting():
        return None
    if not m.consume_token(token):
        return f"structured output: {m.get_error()}"
    return None
