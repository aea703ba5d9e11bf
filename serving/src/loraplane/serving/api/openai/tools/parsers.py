"""``tool_choice: "auto"``: the model answers in text or calls tools in its own format, and a
parser for that format (vLLM's ``--tool-call-parser``, by vLLM's names) reads the calls back.
Without one the server answers such a request with a 400, as vLLM does; with one, the text
before the calls is the answer's content and a stream never shows markup that became a call.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loraplane.serving.api.openai.tools.calls import call_entry, message_calls


class ToolParser(ABC):
    """``tool_choice: "auto"``: the model answers in text or calls tools in its own format, which
    a parser for that format reads back (vLLM's ``--tool-call-parser``). ``parse`` splits a whole
    answer into its text (None when it is only calls) and its calls; ``visible`` is how much of
    an answer still being written may be streamed as text, holding back what may yet turn out to
    be a call. ``visible`` only grows as the answer does, so a stream's text deltas add up."""

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
    def visible(self, text: str) -> str: ...

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
    after any text."""

    name = "hermes"
    START = "<tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def read(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self.CALL.findall(text, start):
            try:
                call = json.loads(body)
                calls.append((str(call["name"]), _arguments(call.get("arguments", {}))))
            except (ValueError, KeyError, TypeError):  # not a call after all: the answer is text
                return text, []
        content = text[:start]
        return (content if content.strip() else None), calls

    def visible(self, text: str) -> str:
        start = text.find(self.START)
        if start >= 0:
            return text[:start]
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):  # a tail that may begin the marker
            if self.START.startswith(text[-k:]):
                return text[:-k]
        return text


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

    def visible(self, text: str) -> str:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.TAG) or self.TAG.startswith(head):
            return ""  # may be a call: held until the answer ends
        return text


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

    def visible(self, text: str) -> str:
        head = text.lstrip()
        if not head or head.startswith(("[", self.START)) or self.START.startswith(head):
            return ""  # may be calls: held until the answer ends
        return text


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser)}


@dataclass(frozen=True)
class AutoAnswer:
    """How ``"auto"``'s answers are read: text, calls, or text then calls, by ``parser``."""

    parser: ToolParser

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

    def delta(self, before: str, now: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """A chunk's new text, and once the answer ends its calls, each whole."""
        text = self.parser.answered(now, finished)[len(self.parser.visible(before)) :]
        calls = self.parser.parse(now)[1] if finished else []
        return text, [call_entry(i, *c) for i, c in enumerate(calls)]
