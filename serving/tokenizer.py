"""The checkpoint's own tokenizer and chat template, read from its folder (no hub access)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        return str(self.hf.convert_ids_to_tokens(token_id))

    def chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        out = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(self.hf.encode(out, add_special_tokens=False))
