"""Incremental detokenisation with stop strings: the streamed text is the text a whole decode
gives, never shows a stop string or a beginning of one that is later cut, and costs the same per
token however long the output grows."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.serving.engine.detokenizer import Detokenizer
from loraplane.serving.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer(tiny_llama)


def stream(tok: Tokenizer, ids: list[int], stops: tuple[str, ...] = ()) -> tuple[list[str], Detokenizer]:
    detok = Detokenizer(tok.decode, stops)
    seen = []
    for t in ids:
        detok.push(t)
        seen.append(detok.visible)
        if detok.stopped:
            break
    detok.flush()
    return seen, detok


# Text with multi-byte characters, which a byte-level BPE splits across tokens.
TEXT = st.lists(st.sampled_from([*"abc de.,\n", "é", "€", "日本", "🙂"]), min_size=1, max_size=40).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=TEXT)
def test_incremental_text_is_the_whole_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    seen, detok = stream(tokenizer, ids)
    assert detok.text == tokenizer.decode(ids) == text
    for earlier, later in itertools.pairwise(seen):
        assert later.startswith(earlier)  # text, once shown, is never taken back
    assert all("\ufffd" not in s for s in seen)  # nor half a character


@settings(max_examples=60, deadline=None)
@given(text=TEXT, stop=st.sampled_from(["de", "c d", "日本", "🙂a", "xyz", ".\n"]))
def test_streamed_text_never_shows_a_stop_string_or_its_cut_beginning(tokenizer: Tokenizer, text: str, stop: str) -> None:
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    seen, detok = stream(tokenizer, ids, (stop,))
    cut = text.find(stop)
    final = text if cut < 0 else text[:cut]
    assert detok.text == final and detok.stopped == (cut >= 0)
    for shown in seen:
        assert stop not in shown and final.startswith(shown)


def test_the_stop_string_ends_the_text_when_it_is_to_be_included(tokenizer: Tokenizer) -> None:
    """vLLM's include_stop_str_in_output: the text ends after the first stop string to begin."""
    ids = tokenizer.hf.encode("ab cd ef gh", add_special_tokens=False)
    detok = Detokenizer(tokenizer.decode, ("ef", "d e"), include_stop=True)
    for t in ids:
        detok.push(t)
    assert detok.stopped and detok.text == detok.visible == "ab cd e"


def test_a_stop_string_split_across_many_tokens_is_held_back_until_it_is_decided(tokenizer: Tokenizer) -> None:
    ids = tokenizer.hf.encode("ab END", add_special_tokens=False)
    detok = Detokenizer(tokenizer.decode, ("ENDING",))
    for t in ids:
        detok.push(t)
    assert detok.text == "ab END" and detok.visible == "ab "  # " END" may still become "ENDING"
    for t in tokenizer.hf.encode("ED", add_special_tokens=False):
        detok.push(t)
    assert detok.visible == "ab ENDED" and not detok.stopped


def test_cost_per_token_does_not_grow_with_the_output(tokenizer: Tokenizer) -> None:
    """Counted in characters decoded, not timed: a whole decode per step would decode ~n²/2."""
    decoded = 0

    def counting(ids: list[int]) -> str:
        nonlocal decoded
        decoded += len(ids)
        return tokenizer.decode(ids)

    ids = tokenizer.hf.encode("the quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)
    detok = Detokenizer(counting, ("never here",))
    for t in ids:
        detok.push(t)
        _ = detok.visible
    assert len(ids) > 400
    assert decoded < 6 * len(ids)


def test_text_written_before_min_tokens_is_never_cut_by_a_stop_string(tokenizer: Tokenizer) -> None:
    """Stop strings do not count before min_tokens: a stop inside that text must not cut what the
    stream already showed once they start to count."""
    detok = Detokenizer(tokenizer.decode, ("ab",))
    for t in tokenizer.hf.encode("xx ab", add_special_tokens=False):
        detok.push(t, find_stops=False)
    shown = detok.visible
    assert shown == "xx ab"
    for t in tokenizer.hf.encode(" c", add_special_tokens=False):
        detok.push(t)
    assert not detok.stopped and detok.visible.startswith(shown)
    for t in tokenizer.hf.encode(" ab d", add_special_tokens=False):
        detok.push(t)
    assert detok.stopped and detok.text == "xx ab c "


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 319), min_size=0, max_size=24), skip=st.booleans())
def test_decode_is_transformers_decode(tokenizer: Tokenizer, ids: list[int], skip: bool) -> None:
    """The engine decodes through the Rust tokenizer directly (the detokenizer calls it twice a
    token); the text is what transformers' own decode gives, special tokens skipped or not."""
    assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)


def test_the_embedded_bases_decode_is_transformers_decode() -> None:
    from loraplane.serving.config import default_cache_dir
    from loraplane.serving.weights.base import resolve_base

    tok = Tokenizer(resolve_base("embedded", default_cache_dir(), weights=False).folder)
    rows = [[], [0], list(range(0, 49152, 977)), [1, 2, 3, 9906, 11, 1076, 30, 2]]
    for ids, skip in itertools.product(rows, (True, False)):
        assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)
