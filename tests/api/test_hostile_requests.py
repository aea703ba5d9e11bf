"""Hostile requests beside another tenant's long stream: each gets an answer or a 4xx naming its
field, the other tenant's stream completes every token, and the server stays ready."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_helpers import Built, tiny_engine

from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import TenantConfig, Tenants

TENANTS = [TenantConfig(name="steady", api_keys=["key-steady"]), TenantConfig(name="hostile", api_keys=["key-hostile"])]
HOSTILE = [
    {"temperature": 1e-40},  # underflows: greedy, not a sampler crash
    {"temperature": 5e-324, "top_p": 1e-300},
    {"top_p": 5e-324},  # rounding put the first token's preceding mass above it: every token dropped, a 500
    {"seed": 18446744073709551616},  # 2**64: reduced to the generator's range
    {"seed": -(2**70)},
    {"seed": 10**400},
    {"prompt": [10**12]},  # a token id outside the vocabulary
    {"prompt": [-1, 2]},
    {"max_tokens": 10**9},
    {"logprobs": 20, "temperature": 1e-30},
    {"top_k": 10**18, "temperature": 1.5},
    {"stop": ["\x00" * 50]},
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("hostile")
    app = create_app(lambda: tiny_engine(tiny_llama, cache, max_model_len=512), tenants=Tenants(TENANTS))
    with serve_app(app) as url:
        yield url


def test_hostile_requests_fail_alone_while_another_tenants_stream_completes(server: str) -> None:
    model = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer key-steady"}).json()["data"][0]["id"]
    steady = {"model": model, "prompt": "a long answer please", "max_tokens": 300, "ignore_eos": True, "stream": True,
              "temperature": 0.8, "seed": 7, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens: list[str] = []
    errors: list[str] = []
    usage: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server}/v1/completions", json=steady, timeout=120,
                          headers={"Authorization": "Bearer key-steady"}) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        errors.append(event["error"]["message"])
                    elif event.get("usage"):
                        usage.append(event["usage"]["completion_tokens"])
                    elif event["choices"] and event["choices"][0]["finish_reason"] is None:
                        tokens.append(event["choices"][0]["text"])

    runner = threading.Thread(target=stream)
    runner.start()
    headers = {"Authorization": "Bearer key-hostile", "Content-Type": "application/json"}
    hostile = httpx.Client(base_url=server, headers=headers, timeout=60)
    for extra in HOSTILE:
        body = {"model": model, "prompt": "hi", "max_tokens": 4, **extra}
        r = hostile.post("/v1/completions", content=json.dumps(body))
        assert r.status_code in (200, 400), (extra, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["message"], extra
    runner.join(120)
    assert not errors
    assert httpx.get(f"{server}/ready").status_code == 200
    assert usage == [300] and tokens, "the steady stream must complete every token"
    body = {k: v for k, v in steady.items() if k not in ("stream", "stream_options")}
    final = httpx.post(f"{server}/v1/completions", headers={"Authorization": "Bearer key-steady"}, json=body, timeout=120)
    assert final.json()["usage"]["completion_tokens"] == 300


def test_bodies_beyond_the_cap_are_refused_with_413_and_stop_lists_are_bounded(server: str) -> None:
    headers = {"Authorization": "Bearer key-hostile", "Content-Type": "application/json"}
    huge = b'{"model": "x", "prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(f"{server}/v1/completions", content=huge, headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap counts what arrives
        yield b'{"model": "x", "prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers=headers, timeout=60)
    assert r.status_code == 413
    for stop in (["s"] * 17, ["x" * 257]):
        r = httpx.post(f"{server}/v1/completions", json={"model": "x", "prompt": "hi", "stop": stop}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop"), r.text
    assert httpx.get(f"{server}/ready").status_code == 200


@pytest.fixture(scope="module")
def plain_server(tiny_llama: Path, tmp_path_factory) -> Iterator[tuple[str, Built]]:
    cache = tmp_path_factory.mktemp("hostile-plain")
    built = Built(lambda: tiny_engine(tiny_llama, cache, max_model_len=512))
    with serve_app(create_app(built)) as url:
        yield url, built


def test_a_prompt_far_beyond_the_context_is_refused_before_it_is_encoded_in_full(plain_server, monkeypatch) -> None:
    url, built = plain_server
    tokenizer = built.get().tokenizer
    encoded: list[int] = []
    real = tokenizer.hf.encode

    def counting(text, *args, **kwargs):  # type: ignore[no-untyped-def]
        encoded.append(len(text))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer.hf, "encode", counting)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    huge = "river stone light garden " * 200_000  # 5 MB, under the body cap
    for path, body in [
        ("/v1/completions", {"model": model, "prompt": huge, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
    ]:
        encoded.clear()
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "messages"), r.text
        assert "512" in r.json()["error"]["message"]
        assert encoded and max(encoded) < len(huge) // 100  # a prefix, not the 5 MB
    ok = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "river stone", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_schema_that_compiles_too_long_is_a_400_and_delays_nobody(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``response_format`` compiles on the grammar compiler's own threads under a deadline: with
    more stuck compiles than the default thread pool has threads, each of their requests is a 400
    naming the field, and another tenant's plain request (tokenised on the default pool) is served
    while they are still stuck."""
    from loraplane.serving.api.openai.completions import generation
    from loraplane.serving.engine.structured import Grammars

    real, release, started = Grammars.compile, threading.Event(), threading.Semaphore(0)

    def stuck(self: Grammars, spec: object, kind: str = "json") -> object:
        started.release()
        release.wait(60)
        return real(self, spec, kind)

    monkeypatch.setattr(Grammars, "compile", stuck)
    monkeypatch.setattr(generation, "COMPILE_DEADLINE_SECONDS", 0.5)
    headers = {"Authorization": "Bearer key-hostile"}
    model = httpx.get(f"{server}/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_object"}}
    post = functools.partial(httpx.post, f"{server}/v1/completions", timeout=30)
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            stuck_ones = [pool.submit(post, json=body, headers=headers) for _ in range(12)]
            assert started.acquire(timeout=30)
            for future in stuck_ones:
                r = future.result()
                assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
                assert "did not compile within" in r.json()["error"]["message"]
            plain = post(json={"model": model, "prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer key-steady"})
            assert plain.status_code == 200
            assert not release.is_set()  # all of it while the compiles were still stuck
    finally:
        release.set()
