"""A sequence's output text, grown one token at a time, with stop strings found as they appear.

Decoding the whole output at every step costs time growing with its length (quadratic over a
request) and lets a stream send the start of a stop string that a later token completes and the
final text then cuts. Instead each new token is decoded in a short window of the tokens before it
(the offsets scheme of Hugging Face's streamers and vLLM's incremental detokeniser): the window's
text minus the text of its first part is what the token adds, and nothing is added while the
window ends inside a multi-byte character. Stop strings are searched for only in the text that
could hold a new match, and the longest tail that is still the beginning of a stop string is held
back from ``visible`` until the next tokens decide it. Every cost is bounded by the window and the
longest stop string, not by the output so far.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
# A window that still ends inside a character after this many tokens is not waiting for a
# character to finish (the model emits stray bytes): let the replacement character through.
MAX_PENDING_TOKENS = 8


class Detokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = (), include_stop: bool = False) -> None:
        """``include_stop``: the text ends after the stop string found (vLLM's
        ``include_stop_str_in_output``), not where it begins."""
        self.decode, self.stops, self.include_stop = decode, stops, include_stop
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window's first token
        self.read_offset = 0  # the first token whose text is not yet in ``text``
        self.text = ""
        self.stopped = False  # a stop string was found; ``text`` ends where it began
        self.floor = 0  # text written while stop strings did not count (min_tokens) is never searched
        # For each stop string, the positions of each of its characters, last first: the tails
        # worth holding back end with the text's last character, so only those are tried.
        self._ends = [
            {c: sorted((i for i, d in enumerate(stop[:-1]) if d == c), reverse=True) for c in set(stop[:-1])} for stop in stops
        ]

    def push(self, token: int, *, find_stops: bool = True) -> None:
        """Add a token's text; after a stop string, nothing more is added. ``find_stops`` is off
        while a request's ``min_tokens`` are not yet generated (stop strings do not count then)."""
        if self.stopped:
            return
        self.ids.append(token)
        window = self.ids[self.prefix_offset :]
        head = self.decode(self.ids[self.prefix_offset : self.read_offset])
        whole = self.decode(window)
        if whole.endswith(REPLACEMENT) and len(self.ids) - self.read_offset < MAX_PENDING_TOKENS:
            return  # a character split across tokens: wait for its remaining bytes
        self._emit(whole[len(head) :], find_stops)

    def flush(self) -> None:
        """At the end of a sequence: the text of tokens still waiting for a character to finish."""
        if not self.stopped and self.read_offset < len(self.ids):
            head = self.decode(self.ids[self.prefix_offset : self.read_offset])
            self._emit(self.decode(self.ids[self.prefix_offset :])[len(head) :], True)

    def _emit(self, new: str, find_stops: bool) -> None:
        before = len(self.text)
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if find_stops:
            self._find_stop(before)
        else:
            self.floor = len(self.text)

    def _find_stop(self, before: int) -> None:
        if not self.stops:
            return
        start = max(self.floor, before - self.longest_stop + 1)  # a match must end in the new text
        found = [(c, s) for s in self.stops if (c := self.text.find(s, start)) >= 0]
        if found:
            cut, stop = min(found, key=lambda f: f[0])  # the first to begin; of those, the first listed
            self.text, self.stopped = self.text[: cut + len(stop) if self.include_stop else cut], True

    @property
    def visible(self) -> str:
        """The text that no later token can take back: all of it but a tail that begins a stop string."""
        if self.stopped or not self.stops:
            return self.text
        if not self.text:
            return ""
        held, last = 0, self.text[-1]
        for stop, ends in zip(self.stops, self._ends, strict=True):
            for i in ends.get(last, ()):
                k = i + 1  # the tail would be stop[:k], which ends with the text's last character
                if k > len(self.text) - self.floor:
                    continue  # it would begin where stop strings do not count
                if k <= held:
                    break
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return self.text[: len(self.text) - held]
