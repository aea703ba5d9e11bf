"""The checkpoint's own tokenizer and chat template, read from its folder (no hub access).

``encode_within`` and ``chat(limit=...)`` answer "too long" for a prompt far beyond the model's
context after encoding only a prefix of it: the server calls them off the event loop for every
request, and a body of megabytes must not cost a full encode to be refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A prefix of this many characters per allowed token is encoded first; tokens are rarely longer
# than a few characters, so a prompt beyond the context shows it there. The margin covers the
# extra pieces of a word cut at the prefix's end.
PREFIX_CHARS_PER_TOKEN = 8
CUT_WORD_MARGIN = 64


class PromptTooLong(ValueError):
    """A prompt with more tokens than the model can take."""


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    @property
    def eos_token_id(self) -> int | None:
        value = self.hf.eos_token_id
        return None if value is None else int(value)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_within(self, text: str, limit: int, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, or ``PromptTooLong`` when they are more than ``limit``, decided
        on a prefix when the prefix already holds more."""
        head = limit * PREFIX_CHARS_PER_TOKEN
        if len(text) > head:
            prefix = self.hf.encode(text[:head], add_special_tokens=add_special_tokens)
            if len(prefix) > limit + CUT_WORD_MARGIN:
                raise PromptTooLong(f"the prompt has more than {limit} tokens, the most this model takes")
        ids = list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        if len(ids) > limit:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens; this model takes at most {limit}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self.hf.convert_ids_to_tokens(token_id))

    def chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, limit: int | None = None) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        out = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        if limit is not None:
            return self.encode_within(out, limit, add_special_tokens=False)
        return list(self.hf.encode(out, add_special_tokens=False))
