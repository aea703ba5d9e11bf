"""The server as a LangChain user meets it: ``langchain-openai``'s chat model and completion LLM,
invoked, streamed, batched and asked for structured output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import tiny_engine
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel, Field

from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def url(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("langchain")
    app = create_app(lambda: tiny_engine(tiny_llama, cache, {"qv4": tiny_adapters["qv4"]}, max_model_len=256))
    with serve_app(app) as base:
        yield f"{base}/v1"


def test_chat_model_invokes_streams_and_batches(url: str) -> None:
    chat = ChatOpenAI(base_url=url, api_key="unused", model="qv4", max_tokens=8, temperature=0, max_retries=0)
    answer = chat.invoke("what is a LoRA adapter?")
    assert answer.content and answer.usage_metadata["output_tokens"] <= 8
    streamed = "".join(str(chunk.content) for chunk in chat.stream("what is a LoRA adapter?"))
    assert streamed == answer.content
    batch = chat.batch(["one", "two", "three"])
    assert len(batch) == 3 and all(m.content for m in batch)


def test_chat_model_structured_output_parses(url: str) -> None:
    chat = ChatOpenAI(base_url=url, api_key="unused", model="qv4", max_tokens=30, temperature=0.7, max_retries=0)
    verdict = chat.with_structured_output(Verdict, method="json_schema").invoke("judge this answer")
    assert isinstance(verdict, Verdict)


def test_completion_llm_sends_prompt_lists(url: str) -> None:
    """``OpenAI.generate`` batches its prompts into one request with a list of prompts."""
    llm = OpenAI(base_url=url, api_key="unused", model="qv4", max_tokens=5, temperature=0, max_retries=0, batch_size=4)
    result = llm.generate(["the quick brown fox", "a platform team", "serves many fine-tunes"])
    texts = [g[0].text for g in result.generations]
    assert len(texts) == 3
    assert texts[0] == llm.invoke("the quick brown fox")
    assert result.llm_output["token_usage"]["completion_tokens"] <= 15
