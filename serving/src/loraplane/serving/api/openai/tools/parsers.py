"""``tool_choice: "auto"``: the model answers in text or calls tools in its own format, and a
parser for that format (vLLM's ``--tool-call-parser``, by vLLM's names) reads the calls back.
Without one the server answers such a request with a 400, as vLLM does; with one, the text
before the calls is the answer's content and a stream never shows markup that became a call.
"""

from __future__ import annotations

import ast
import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplane.serving.api.openai.tools.calls import call_entry, message_calls


class Watch(ABC):
    """How much of one answer, still being written, a stream may show as text: ``visible`` is
    called with the answer each time it grows and returns a length that only grows. It keeps what
    it learnt of the text it has seen, so a whole stream costs time linear in the answer (called
    afresh on every token, a scan of the whole answer made a long answer's stream quadratic)."""

    @abstractmethod
    def visible(self, text: str) -> int: ...


class ToolParser(ABC):
    """``tool_choice: "auto"``: the model answers in text or calls tools in its own format, which
    a parser for that format reads back (vLLM's ``--tool-call-parser``). ``parse`` splits a whole
    answer into its text (None when it is only calls) and its calls; a ``watch`` says how much of
    an answer still being written may be streamed as text, holding back what may yet turn out to
    be a call. Both take time linear in the answer: a tenant chooses what the model writes."""

    name = ""
    parse: Callable[[str], tuple[str | None, list[tuple[str, str]]]]

    def __init__(self) -> None:
        # An answer is read when it ends for its content, its calls and its finish reason, and
        # reading a long one is not free (the pythonic parser runs Python's parser): once each.
        self.parse = functools.lru_cache(maxsize=16)(self.read)

    @abstractmethod
    def read(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """``parse`` itself, uncached."""

    @abstractmethod
    def watch(self) -> Watch:
        """A new answer's ``Watch``."""

    def visible(self, text: str) -> str:
        """The text a stream shows of ``text`` while it is being written."""
        return text[: self.watch().visible(text)]

    def answered(self, text: str, finished: bool) -> str:
        """``visible``, and once finished the text ``parse`` keeps."""
        if not finished:
            return self.visible(text)
        content, calls = self.parse(text)
        return text if not calls else content or ""


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json_text(value)


def json_text(value: Any) -> str:
    """A value as JSON text, non-ASCII written as itself (as vLLM writes arguments), except where
    the value holds a lone surrogate (``"\\ud800"`` in the model's text): that has no UTF-8, so it
    is escaped. No NaN or infinity: JSON has none (a ``ValueError``)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    return text


class HermesParser(ToolParser):
    """Hermes' and Qwen's format: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    after any text. Read by finding the markers (a call not closed runs to the end), not by a
    pattern that backtracks."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def read(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls, at = [], start
        while at >= 0:
            body = at + len(self.START)
            end = text.find(self.END, body)
            try:
                call = json.loads(text[body : len(text) if end < 0 else end])
                calls.append((str(call["name"]), _arguments(call.get("arguments", {}))))
            except (ValueError, KeyError, TypeError):  # not a call after all: the answer is text
                return text, []
            at = -1 if end < 0 else text.find(self.START, end + len(self.END))
        content = text[:start]
        return (content if content.strip() else None), calls

    def watch(self) -> Watch:
        return _MarkerWatch(self.START)


class _MarkerWatch(Watch):
    """Text up to a marker that starts the calls, less a tail that may begin it. The marker is
    looked for only in what is new (and the few characters before it a marker may straddle)."""

    def __init__(self, marker: str) -> None:
        self.marker, self.searched, self.cut = marker, 0, -1

    def visible(self, text: str) -> int:
        if self.cut < 0:
            self.cut = text.find(self.marker, max(0, self.searched - len(self.marker) + 1))
            self.searched = len(text)
        if self.cut >= 0:
            return self.cut
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):  # a tail that may begin the marker
            if text.endswith(self.marker[:k]):
                return len(text) - k
        return len(text)


class _HeadWatch(Watch):
    """For formats whose answer is calls only when it begins like one: nothing is shown until
    the first characters that are not blank decide it, then all of it or none of it until the end."""

    def __init__(self, may_call: Callable[[str], bool | None]) -> None:
        self.may_call, self.lead = may_call, 0
        self.call: bool | None = None  # undecided

    def visible(self, text: str) -> int:
        if self.call is None:
            while self.lead < len(text) and text[self.lead].isspace():
                self.lead += 1
            if self.lead < len(text):
                self.call = self.may_call(text[self.lead : self.lead + _HEAD])
        return len(text) if self.call is False else 0


_HEAD = 32  # enough characters to tell each format's opening from text


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON tool calling: the answer is one or more ``{"name": ..., "parameters":
    {...}}`` objects (after ``<|python_tag|>`` when special tokens are kept), separated by ``;``,
    or it is text."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def read(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), list[tuple[str, str]](), 0
        while at < len(body):
            try:
                call, at = decoder.raw_decode(body, at)
                calls.append((str(call["name"]), _arguments(call.get("parameters", call.get("arguments", {})))))
            except (ValueError, KeyError, TypeError):
                return text, []
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def watch(self) -> Watch:
        return _HeadWatch(self._may_call)

    def _may_call(self, head: str) -> bool | None:
        if head.startswith(("{", self.TAG)):
            return True  # may be a call: held until the answer ends
        return None if self.TAG.startswith(head) else False


class PythonicParser(ToolParser):
    """Llama 3.2's and Llama 4's Python-style calls: the answer is one list of calls with keyword
    arguments, ``[get_weather(city="paris", days=3), ping()]`` (between ``<|python_start|>`` and
    ``<|python_end|>`` when special tokens are kept), or it is text. Read with Python's own
    parser, each argument a literal (``ast.literal_eval``: nothing is run); an argument that is
    not a literal JSON can hold, or a list that is not only such calls, makes the answer text."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def read(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return text, []
        try:
            calls = self._calls(ast.parse(body, mode="eval").body)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return (None, calls) if calls else (text, [])

    @staticmethod
    def _calls(node: ast.expr) -> list[tuple[str, str]]:
        if not isinstance(node, ast.List):
            raise ValueError("not a list")
        calls = []
        for call in node.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                raise ValueError("not a call with keyword arguments")
            if any(k.arg is None for k in call.keywords):  # **kwargs
                raise ValueError("not a keyword argument")
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append((call.func.id, json_text(arguments)))
        return calls

    def watch(self) -> Watch:
        return _HeadWatch(self._may_call)

    def _may_call(self, head: str) -> bool | None:
        if head.startswith(("[", self.START)):
            return True  # may be calls: held until the answer ends
        return None if self.START.startswith(head) else False


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser)}


@dataclass(frozen=True)
class AutoAnswer:
    """How ``"auto"``'s answers to one request are read: text, calls, or text then calls, by
    ``parser``; a stream's choices each keep their own ``Watch``."""

    parser: ToolParser
    watches: dict[int, tuple[Watch, list[int]]] = field(default_factory=dict)

    def message(self, text: str, echoed: str = "") -> dict[str, Any]:
        """A whole answer's chat message: its text (null when there is none) and its calls, if any."""
        content, calls = self.parser.parse(text)
        content = echoed + (content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = message_calls(calls)
        return message

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """vLLM's: ``tool_calls`` when the answer called a tool."""
        return "tool_calls" if reason is not None and self.parser.parse(text)[1] else reason

    def shown(self, index: int, text: str, finished: bool) -> str:
        """Choice ``index``'s text not shown before, now that its answer is ``text``: what cannot
        be a call yet, and once it ends the rest of the text ``parse`` keeps."""
        watch, shown = self.watches.setdefault(index, (self.parser.watch(), [0]))
        new = self.parser.answered(text, True)[shown[0] :] if finished else text[shown[0] : watch.visible(text)]
        shown[0] += len(new)
        return new

    def delta(self, index: int, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """A chunk's new text, and once the answer ends its calls, each whole."""
        calls = self.parser.parse(text)[1] if finished else []
        return self.shown(index, text, finished), [call_entry(i, *c) for i, c in enumerate(calls)]
