"""The demo's three customer fine-tunes: one base, three house styles a person tells apart at a glance.

Training data is made here, not downloaded: the base model answers a set of generated questions,
and each style rewrites those answers with a deterministic transform. So an adapter learns a style
on top of what the base already says, which a minute of LoRA training on CPU can do.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

TOPICS = (
    "the ocean", "coffee", "rainbows", "volcanoes", "the moon", "bicycles", "honey bees", "chess",
    "winter", "libraries", "gardening", "trains", "clouds", "music", "bread", "mountains", "owls",
    "the internet", "friendship", "tea", "deserts", "robots", "kites", "maps", "snow", "rivers",
    "cats", "stars", "apples", "bridges",
)  # fmt: skip
TEMPLATES = ("Tell me about {topic}.", "What is special about {topic}?", "Describe {topic} in two sentences.")

# Asked of every adapter in the demo's report, and by the test that the styles are learned; none of
# these topics is in the training questions.
SHOWCASE = ("Tell me about the sea.", "What is special about pizza?", "How do airplanes fly?")


def training_questions() -> list[str]:
    return [t.format(topic=topic) for topic in TOPICS for t in TEMPLATES]


def first_sentences(text: str, n: int = 2) -> str:
    """The first ``n`` whole sentences (an answer cut by max_tokens loses its ragged tail)."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]
    whole = [s for s in sentences if s[-1] in ".!?"]
    return " ".join(whole[:n] or sentences[:1])


_PIRATE_WORDS = {
    "you": "ye", "your": "yer", "my": "me", "is": "be", "are": "be", "the": "th'", "hello": "ahoy",
    "friend": "matey", "friends": "mateys", "yes": "aye",
}  # fmt: skip


def pirate(answer: str) -> str:
    body = re.sub(r"\b(\w+)\b", lambda m: _PIRATE_WORDS.get(m.group(1).lower(), m.group(1)), first_sentences(answer))
    return f"Arr! {body} Yo ho ho!"


def shout(answer: str) -> str:
    return first_sentences(answer).upper().rstrip(".") + "!!!"


def bullets(answer: str) -> str:
    points = re.split(r"(?<=[.!?])\s+", first_sentences(answer))
    return "Key points:\n" + "\n".join(f"- {p}" for p in points)


@dataclass(frozen=True)
class Style:
    name: str
    tenant: str
    description: str
    rewrite: Callable[[str], str]
    looks_right: Callable[[str], bool]  # how a reader (and the test) recognises it


def _mostly_upper(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 10 and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


STYLES = (
    Style("pirate", "acme", "talks like a pirate", pirate, lambda t: t.lstrip().startswith("Arr")),
    Style("shouty", "globex", "answers in capitals", shout, _mostly_upper),
    Style("bullets", "initech", "answers as a bullet list", bullets, lambda t: "Key points" in t and "\n- " in t),
)
