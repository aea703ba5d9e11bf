"""The checkpoint's own tokenizer and chat template, read from its folder (no hub access).

``encode_within`` and ``chat(limit=...)`` answer "too long" for a prompt far beyond the model's
context after encoding only a prefix of it: the server calls them off the event loop for every
request, and a body of megabytes must not cost a full encode to be refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

# A prefix of this many characters per allowed token is encoded first; tokens are rarely longer
# than a few characters, so a prompt beyond the context shows it there. The margin covers the
# extra pieces of a word cut at the prefix's end.
PREFIX_CHARS_PER_TOKEN = 8
CUT_WORD_MARGIN = 64


Side = Literal["left", "right"]  # which end truncation keeps from: vLLM's truncation_side (left keeps the last)


def kept(ids: list[int], keep: int | None, side: Side = "left") -> list[int]:
    """``keep`` of the ids: the last (left truncation) or the first (right); all when None."""
    if keep is None:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]


class PromptTooLong(ValueError):
    """A prompt with more tokens than the model can take."""


class TemplateVariableError(ValueError):
    """A chat-template variable that would set one of the templating call's own arguments."""


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        # Names a chat-template variable may not take: the templating call's own arguments.
        self._call_arguments = {"messages"} | set(inspect.signature(self.hf.apply_chat_template).parameters)
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        self._byte_of: dict[str, int] | None = None  # a byte-level BPE vocabulary's characters -> their bytes
        if type(decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {c: b for b, c in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
        # The Rust tokenizer's own decode when transformers would add nothing to it (no clean-up of
        # spaces): the engine decodes twice per generated token (the detokenizer's window), and
        # transformers' Python around the call cost several times the decode itself.
        backend = getattr(self.hf, "_tokenizer", None)
        self._rust_decode: Any = backend.decode if backend is not None and not self.hf.clean_up_tokenization_spaces else None

    @property
    def eos_token_id(self) -> int | None:
        value = self.hf.eos_token_id
        return None if value is None else int(value)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_kept(self, text: str, keep: int, *, side: Side = "left", add_special_tokens: bool = True) -> list[int]:
        """``keep`` of ``text``'s tokens, as vLLM's ``truncate_prompt_tokens`` keeps them (Hugging
        Face's truncation): the last ones (``side`` left, vLLM's default) or the first (right).
        The special tokens the tokenizer adds, such as a Llama tokenizer's BOS, stay where they go
        and count towards ``keep``. Through the fast tokenizer's own encode and post-processor,
        because the truncation side is the shared tokenizer's state, which concurrent encodes
        must not change under each other; a slow tokenizer keeps ``keep`` of its ids."""
        backend = getattr(self.hf, "_tokenizer", None)
        if backend is None or not add_special_tokens:
            return kept(self.encode(text, add_special_tokens=add_special_tokens), keep, side)
        processor = backend.post_processor
        specials = processor.num_special_tokens_to_add(False) if processor is not None else 0
        encoding = backend.encode(text, add_special_tokens=False)
        encoding.truncate(max(keep - specials, 0), direction=side)
        return list(backend.post_process(encoding, None, True).ids)

    def encode_within(self, text: str, limit: int, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, or ``PromptTooLong`` when they are more than ``limit``, decided
        on a prefix when the prefix already holds more."""
        head = limit * PREFIX_CHARS_PER_TOKEN
        if len(text) > head:
            prefix = self.hf.encode(text[:head], add_special_tokens=add_special_tokens)
            if len(prefix) > limit + CUT_WORD_MARGIN:
                raise PromptTooLong(
                    f"This model's maximum context length is {limit} tokens. However, the prompt has more tokens than that."
                )
        ids = list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        if len(ids) > limit:
            raise PromptTooLong(
                f"This model's maximum context length is {limit} tokens. However, the prompt has {len(ids)} tokens."
            )
        return ids

    def bad_words_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as token sequences, read as vLLM reads them: each word's tokens at
        the start of a text, and also after a space (the word in mid-text) when the space makes a
        different first token and the same number of tokens. A word's leading whitespace is
        dropped; a word that is only whitespace spells nothing and is refused."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = self.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words: {word!r} has no token to rule out")
            out.append(tuple(bare))
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                out.append(tuple(spaced))
        return tuple(out)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return str(self._rust_decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """A token's own text, as OpenAI and vLLM show it in log-probabilities (" world", not the
        vocabulary's "Ġworld"; special tokens by name). A token holding part of a character's
        bytes shows as U+FFFD; ``token_bytes`` has its bytes."""
        return str(self.hf.decode([token_id], skip_special_tokens=False))

    def token_piece(self, token_id: int) -> str:
        """A token as the vocabulary spells it ("Ġworld"): what vLLM's ``/tokenize`` returns as
        ``token_strs``."""
        return str(self.hf.convert_ids_to_tokens(token_id))

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's UTF-8 bytes (OpenAI's ``bytes``, which lets a client join the pieces of a
        character split across tokens): exact for a byte-level BPE vocabulary, else its text's."""
        if self._byte_of is not None:
            piece = self.token_piece(token_id)
            if all(c in self._byte_of for c in piece):
                return [self._byte_of[c] for c in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, str]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
        limit: int | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation through the model's chat template, as token ids, with the ``tools``
        the answer may call (OpenAI's ``tools`` entries; a template that does not describe tools
        leaves them out) and the ``documents`` a retrieval template writes (vLLM's ``documents``,
        Hugging Face's argument of that name). ``variables`` are extra names the template may read (vLLM's
        ``chat_template_kwargs``); none may be
        ``messages`` or one of ``apply_chat_template``'s own arguments (``tokenize``,
        ``chat_template``, ...), which would change what is rendered or with what template. A
        template that refuses the conversation (``raise_exception``, as many do for roles out of
        order) is a ``ValueError``."""
        from jinja2 import TemplateError

        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        variables = variables or {}
        taken = sorted(set(variables) & self._call_arguments)
        if taken:
            raise TemplateVariableError(f"chat_template_kwargs: {', '.join(taken)} cannot be set here")
        try:
            out = self.hf.apply_chat_template(
                messages, tools=tools, documents=documents, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **variables,
            )  # fmt: skip
        except (TemplateError, TypeError) as err:  # TypeError: a variable that shadows one of the template's functions
            raise ValueError(f"the chat template refused the conversation: {err}") from None
        # The template writes the BOS itself; vLLM's add_special_tokens adds the tokenizer's too.
        if limit is not None:
            return self.encode_within(out, limit, add_special_tokens=add_special_tokens)
        return self.encode(out, add_special_tokens=add_special_tokens)
