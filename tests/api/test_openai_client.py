"""The server against the official ``openai`` client on loopback: chat and completions, streamed
and not, model listing, OpenAI-shaped errors, and vLLM's LoRA load/unload calls."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from engine_helpers import Built, tiny_engine

from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import free_port, serve_app
from loraplane.serving.http.metrics_port import serve_metrics

ADMIN = "admin-secret"
APPS: dict[str, object] = {}
ENGINES: dict[str, Built] = {}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("api-cache")
    adapters = {"qv4": tiny_adapters["qv4"], "all8": tiny_adapters["all8"]}
    built = Built(lambda: tiny_engine(tiny_llama, cache, adapters, max_model_len=256))
    app = create_app(built, admin_token=ADMIN)
    with serve_app(app) as url:
        APPS[url], ENGINES[url] = app, built
        yield url


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_lists_base_and_adapters(client: openai.OpenAI, tiny_llama: Path) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == tiny_llama.name and set(ids[1:]) == {"qv4", "all8"}


def test_completion_plain_and_streamed_agree(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="qv4", prompt="the quick brown fox", max_tokens=8, temperature=0)
    assert 1 <= plain.usage.completion_tokens <= 8
    assert plain.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.completions.create(model="qv4", prompt="the quick brown fox", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    bare = client.completions.create(
        model=client.models.list().data[0].id, prompt="the quick brown fox", max_tokens=8, temperature=0
    )
    assert bare.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_plain_and_streamed_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "a platform team serves many fine-tunes"}]
    plain = client.chat.completions.create(model="all8", messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    stream = client.chat.completions.create(
        model="all8", messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="qv4", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_unknown_adapter_is_a_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "qv4", "prompt": "hi", "max_tokens": -1},
        {"model": "qv4", "prompt": "hi", "max_tokens": 10**9},
        {"model": "qv4", "prompt": "hi", "temperature": "hot"},
        {"model": "qv4", "prompt": "hi", "best_of": 3},
        {"model": "qv4", "prompt": "hi " * 400, "max_tokens": 8},
        {"model": "qv4", "prompt": "", "max_tokens": 8},
        {"model": "qv4"},
    ],
)
def test_bad_requests_are_400s_and_the_server_lives_on(server: str, client: openai.OpenAI, body: dict) -> None:
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    assert client.completions.create(model="qv4", prompt="hi", max_tokens=2).choices


def test_malformed_json_and_bad_utf8_are_400s(server: str) -> None:
    # NUL bytes are a body the JSON decoder cannot even guess the encoding of (Starlette's own 400).
    for raw in (b"{not json", b'{"model": "qv4", "prompt": "\xff\xfe"}', b"\x00" * 9):
        r = httpx.post(f"{server}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_unknown_routes_and_methods_answer_in_openais_error_shape(server: str, client: openai.OpenAI) -> None:
    r = httpx.post(f"{server}/v1/embeddings", json={"model": "qv4", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"
    r = httpx.get(f"{server}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] and "POST" in r.headers["allow"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="qv4", input="hi")


def test_load_and_unload_lora_need_the_admin_token(server: str, client: openai.OpenAI, tiny_adapters: dict[str, Path]) -> None:
    body = {"lora_name": "ku2", "lora_path": str(tiny_adapters["ku2"])}
    assert httpx.post(f"{server}/v1/load_lora_adapter", json=body).status_code == 401
    auth = {"authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{server}/v1/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200 and "ku2" in r.text
    assert client.completions.create(model="ku2", prompt="hi", max_tokens=2).choices
    state = httpx.get(f"{server}/admin/adapters/ku2", headers=auth).json()
    assert state["requests"] == 1 and state["tier"] == "device"
    pinned = httpx.post(f"{server}/admin/adapters/ku2/pin", headers=auth).json()
    assert pinned["pinned"] is True
    for name in ("qv4", "all8"):  # 3 of the 4 slots pinned: the most that leaves one for the rest
        assert httpx.post(f"{server}/admin/adapters/{name}/pin", headers=auth).status_code == 200
    extra = {"lora_name": "mlp16", "lora_path": str(tiny_adapters["mlp16"])}
    assert httpx.post(f"{server}/v1/load_lora_adapter", json=extra, headers=auth).status_code == 200
    refused = httpx.post(f"{server}/admin/adapters/mlp16/pin", headers=auth)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "pin_limit_reached", refused.text
    assert httpx.get(f"{server}/admin/adapters/mlp16", headers=auth).json()["pinned"] is False
    for name in ("ku2", "qv4", "all8"):
        httpx.post(f"{server}/admin/adapters/{name}/unpin", headers=auth)
    httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "mlp16"}, headers=auth)
    bad = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"}, headers=auth)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "MissingFile"  # vLLM's answer for no adapter there
    # A name already served is replaced only when asked to, as vLLM answers.
    twice = httpx.post(f"{server}/v1/load_lora_adapter", json=body, headers=auth)
    assert twice.status_code == 400 and "already been loaded" in twice.json()["error"]["message"]
    assert client.completions.create(model="ku2", prompt="hi", max_tokens=2).choices
    # vLLM's own fields: tools written for its endpoint send them.
    again = {**body, "load_inplace": True, "lora_int_id": 7}
    assert httpx.post(f"{server}/v1/load_lora_adapter", json=again, headers=auth).status_code == 200
    assert httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "ku2"}, headers=auth).status_code == 200
    empty = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": ""}, headers=auth)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "lora_name", empty.text  # as vLLM answers
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ku2", prompt="hi", max_tokens=2)


def test_metrics_and_health(server: str) -> None:
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server}/metrics").text
    assert "loraplane_requests_total" in text and "loraplane_adapter_tier" in text


def test_the_metrics_port_serves_the_same_series_and_nothing_else(server: str) -> None:
    """What `loraplane serve --metrics-port` starts: the scraper's port carries no API."""
    port = free_port()
    metrics = serve_metrics(APPS[server].state.metrics, "127.0.0.1", port)  # type: ignore[attr-defined]
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "loraplane_requests_total" in text and "loraplane_adapter_tier" in text and "loraplane_disk_cache_bytes" in text
        engine = ENGINES[server].get()
        before = sum(c.requests for c in engine.metrics.counts.values())
        body = {"model": "qv4", "prompt": "hi", "max_tokens": 2}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        assert "choices" not in answer.text  # no completion runs here
        assert sum(c.requests for c in engine.metrics.counts.values()) == before
    finally:
        metrics.shutdown()


def test_a_client_that_disconnects_frees_its_sequence(server: str) -> None:
    engine = ENGINES[server].get()
    body = {"model": "qv4", "prompt": "the quick brown fox", "max_tokens": 240, "stream": True, "temperature": 0}
    before = engine.metrics.counts["qv4"].completion_tokens
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token received, then hang up
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.metrics.counts["qv4"].completion_tokens - before < 200, "the request ran on after the client left"


def test_a_client_that_leaves_before_a_plain_answer_aborts_it(server: str) -> None:
    """Not streamed, the response starts only when the whole answer is done: the engine must not
    compute it for a client that has gone (it aborts at the disconnect, as vLLM does)."""
    engine = ENGINES[server].get()
    body = {"model": "qv4", "prompt": "the quick brown fox", "max_tokens": 240, "n": 4, "ignore_eos": True}
    before = engine.metrics.counts["qv4"].completion_tokens
    with pytest.raises(httpx.ReadTimeout):  # 4 x 240 tokens take about a second here; the client leaves after 0.1 s
        httpx.post(f"{server}/v1/completions", json=body, timeout=0.1)
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert engine.metrics.counts["qv4"].completion_tokens - before < 4 * 240, "the answer ran on after the client left"


def test_a_prefetch_lands_in_host_memory_with_no_traffic(server: str, tiny_adapters: dict[str, Path], tiny_llama: Path) -> None:
    """What the operator relies on when it stages an adapter: an idle server still finishes the load."""
    admin = httpx.Client(base_url=server, headers={"Authorization": f"Bearer {ADMIN}"})
    assert admin.get("/admin/base").json()["name"] == tiny_llama.name
    admin.post(
        "/admin/adapters", json={"lora_name": "staged", "lora_path": str(tiny_adapters["ku2"]), "tenant": "t", "version": "v2"}
    )
    assert admin.post("/admin/adapters/staged/prefetch").status_code == 200
    deadline = time.monotonic() + 10
    while (state := admin.get("/admin/adapters/staged").json())["tier"] == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state["tier"] == "host" and state["version"] == "v2" and state["requests"] == 0


def test_models_are_retrieved_one_by_one_with_their_root(client: openai.OpenAI, tiny_llama: Path, tiny_adapters) -> None:
    base = client.models.retrieve(tiny_llama.name)
    assert base.id == tiny_llama.name and getattr(base, "root", None) == str(tiny_llama)
    adapter = client.models.retrieve("qv4")
    assert getattr(adapter, "parent", None) == tiny_llama.name and getattr(adapter, "root", None) == str(tiny_adapters["qv4"])
    listed = {m.id: getattr(m, "root", None) for m in client.models.list().data}
    assert listed["qv4"] == str(tiny_adapters["qv4"])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_content_parts_and_usage_on_every_chunk(client: openai.OpenAI) -> None:
    """What OpenAI-compatible load generators send (guidellm among them): content as a list of
    text parts (joined with newlines, as vLLM joins them), and vLLM's continuous_usage_stats."""
    plain = [{"role": "user", "content": "a platform team\nserves many fine-tunes"}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a platform team"}, {"type": "text", "text": "serves many fine-tunes"}],
        }
    ]
    a = client.chat.completions.create(model="all8", messages=plain, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model="all8", messages=parts, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        model="all8", messages=parts, max_tokens=6, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    ))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(model="all8", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])  # fmt: skip
    assert "image_url" in image.value.message


def test_stream_options_without_stream_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="qv4", prompt="hi", max_tokens=2, stream_options={"include_usage": True})
    assert "stream_options" in err.value.message


def test_logprobs_zero_gives_the_chosen_tokens_entry(client: openai.OpenAI) -> None:
    out = client.completions.create(model="qv4", prompt="the quick brown fox", max_tokens=3, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert [list(step) for step in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert all(step[t] == v for step, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs, strict=True))
