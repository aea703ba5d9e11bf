"""Tenants on the server: keys, isolation that does not leak, quotas answering 429, usage records,
and load shedding under overload."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from engine_helpers import Built, tiny_engine

from loraplane.serving.api.app import create_app
from loraplane.serving.http import tenants as tenants_module
from loraplane.serving.http.errors import APIError
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import TenantConfig, Tenants, load_tenants
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.usage import Metering

ENGINES: dict[str, Built] = {}
TENANTS = {
    "tenants": [
        {"name": "acme", "api_keys": ["key-acme"]},
        {"name": "globex", "api_keys": ["key-globex"], "allow_base": False, "max_concurrent": 1},
        {"name": "tiny", "api_keys": ["key-tiny"], "tokens_per_minute": 30},
        {"name": "metered", "api_keys": ["key-metered"], "tokens_per_minute": 80},
        {"name": "initech", "api_keys": ["key-initech"]},
        {"name": "counter", "api_keys": ["key-counter"], "tokens_per_minute": 30},
    ]
}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("tenants")
    (root / "tenants.json").write_text(json.dumps(TENANTS))
    usage = root / "usage"

    def make():  # type: ignore[no-untyped-def]
        engine = tiny_engine(tiny_llama, root / "cache", max_model_len=256)
        engine.register_lora(AdapterSpec("acme-bot", str(tiny_adapters["qv4"]), tenant="acme"))
        engine.register_lora(AdapterSpec("globex-bot", str(tiny_adapters["all8"]), tenant="globex"))
        engine.register_lora(AdapterSpec("tiny-bot", str(tiny_adapters["ku2"]), tenant="tiny"))
        return engine

    built = Built(make)
    app = create_app(
        built, tenants=Tenants(load_tenants(root / "tenants.json")), max_pending_requests=3,
        metering=Metering.create("pod-t", usage),
    )  # fmt: skip
    with serve_app(app) as url:
        ENGINES[url] = built
        yield url, usage


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def slow_engine(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine step 10 ms longer, so requests overlap on the tiny model."""
    engine = ENGINES[url].get()
    real_step = engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)


def test_keys_are_required_and_checked(server) -> None:
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        _client(url, "wrong").models.list()
    assert httpx.get(f"{url}/v1/models").status_code == 401


def test_each_tenant_lists_and_calls_only_its_own(server, tiny_llama: Path) -> None:
    url, _ = server
    acme, globex = _client(url, "key-acme"), _client(url, "key-globex")
    assert [m.id for m in acme.models.list().data] == [tiny_llama.name, "acme-bot"]
    assert [m.id for m in globex.models.list().data] == ["globex-bot"]  # no base access
    assert acme.completions.create(model="acme-bot", prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.NotFoundError) as theirs:
        acme.completions.create(model="globex-bot", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as missing:
        acme.completions.create(model="no-such-bot", prompt="hi", max_tokens=2)
    # Another tenant's adapter is indistinguishable from a missing one.
    assert theirs.value.body["message"].replace("globex-bot", "X") == missing.value.body["message"].replace("no-such-bot", "X")
    with pytest.raises(openai.NotFoundError):
        globex.completions.create(model=tiny_llama.name, prompt="hi", max_tokens=2)
    # vLLM's tokenizer routes answer as the completions do: a key, and only the caller's models.
    body = {"model": "globex-bot", "prompt": "hi"}
    assert httpx.post(f"{url}/tokenize", json=body).status_code == 401
    assert httpx.post(f"{url}/tokenize", json=body, headers={"Authorization": "Bearer key-acme"}).status_code == 404
    assert httpx.post(f"{url}/tokenize", json=body, headers={"Authorization": "Bearer key-globex"}).json()["count"] > 0


def test_one_tenants_cached_prompt_is_invisible_to_another(server, tiny_llama: Path) -> None:
    """The prefix cache is scoped by tenant (and by vLLM's ``cache_salt`` within one): a cached
    token count or a faster first token would otherwise tell a tenant what another one sent."""
    url, _ = server
    acme, initech = _client(url, "key-acme"), _client(url, "key-initech")
    prompt = list(range(7, 7 + 70))

    def cached(client: openai.OpenAI, **extra: object) -> int:
        out = client.completions.create(model=tiny_llama.name, prompt=prompt, max_tokens=1, extra_body=extra)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    cached(acme)
    assert cached(acme) > 0  # the tenant's own repeat is served from the cache, and says so
    assert cached(initech) == 0  # the same prompt from another tenant is computed anew
    assert cached(acme, cache_salt="user-1") == 0
    assert cached(acme, cache_salt="user-1") > 0
    with pytest.raises(openai.BadRequestError) as empty:
        cached(acme, cache_salt="")
    assert "cache_salt" in str(empty.value)


def test_concurrency_quota_answers_429_with_retry_after(server, monkeypatch) -> None:
    url, _ = server
    slow_engine(url, monkeypatch)  # the tiny model would finish 200 tokens before the second request lands
    body = {"model": "globex-bot", "prompt": "the quick brown fox", "max_tokens": 200, "stream": True, "ignore_eos": True}
    headers = {"authorization": "Bearer key-globex"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as first:
        assert first.status_code == 200, first.read()
        lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        second = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, headers=headers)
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "rate_limit_error"
    # The slot comes back once the first request is gone.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=headers)
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200


def test_tokens_per_minute_quota(server) -> None:
    url, usage = server
    tiny = _client(url, "key-tiny")
    tiny.completions.create(model="tiny-bot", prompt="the quick brown fox jumps", max_tokens=30, extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError) as err:
        tiny.completions.create(model="tiny-bot", prompt="hi", max_tokens=2)
    assert int(err.value.response.headers["retry-after"]) >= 1
    records = [json.loads(line) for p in usage.glob("*.jsonl*") for line in p.read_text().splitlines()]
    mine = [r for r in records if r["tenant"] == "tiny" and r["outcome"] == "completed"]
    assert mine and mine[0]["adapter"] == "tiny-bot" and mine[0]["completion_tokens"] == 30


def test_concurrent_requests_cannot_overshoot_a_token_quota(server, tiny_llama: Path, monkeypatch) -> None:
    """Three requests at once, each a short prompt and 25 tokens, against 80 a minute: counting
    only what finished requests used would admit all three (over 100 tokens); each reserves its
    most at admission, so two fit and the third is refused."""
    url, _ = server
    slow_engine(url, monkeypatch)
    body = {"model": tiny_llama.name, "prompt": "one two three", "max_tokens": 25, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    answers: list[httpx.Response] = []

    def send() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"authorization": "Bearer key-metered"},
                          timeout=60) as r:  # fmt: skip
            r.read()
            answers.append(r)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in answers if r.status_code == 429]
    assert len(refused) == 1 and sorted(r.status_code for r in answers) == [200, 200, 429], [r.text for r in answers]
    assert "reserved by requests in flight" in refused[0].json()["error"]["message"]
    final = [json.loads(line[6:]) for r in answers if r.status_code == 200 for line in r.text.splitlines()
             if line.startswith("data: {") and not json.loads(line[6:])["choices"]]  # fmt: skip
    assert len(final) == 2 and all(f["usage"]["completion_tokens"] == 25 for f in final)
    assert sum(f["usage"]["total_tokens"] for f in final) <= 80


def test_overload_is_shed_with_503_and_accepted_requests_complete(server, monkeypatch) -> None:
    url, _ = server
    slow_engine(url, monkeypatch)
    headers = {"authorization": "Bearer key-acme"}
    body = {"model": "acme-bot", "prompt": "the quick brown fox", "max_tokens": 120, "ignore_eos": True}
    results: list[int] = []

    def send() -> None:
        results.append(httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60).status_code)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) <= {200, 503} and 503 in results and 200 in results


def test_a_tenants_burst_is_shed_without_shedding_its_neighbour(server, monkeypatch) -> None:
    """``max_pending_requests`` is 3 here. One tenant's streams fill it: that tenant's next request
    is shed with 503 and ``Retry-After``, while another tenant, below its share, is still served."""
    url, _ = server
    slow_engine(url, monkeypatch)
    acme = {"authorization": "Bearer key-acme"}
    burst = {"model": "acme-bot", "prompt": "the quick brown fox", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with contextlib.ExitStack() as streams:
        for _ in range(3):
            response = streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=burst, headers=acme, timeout=60))
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            next(lines)
            streams.callback(lambda kept=lines: kept)  # a collected iterator would close its stream
        shed = httpx.post(f"{url}/v1/completions", json={**burst, "stream": False, "max_tokens": 2}, headers=acme)
        assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == "overloaded"
        neighbour = httpx.post(
            f"{url}/v1/completions", json={"model": "globex-bot", "prompt": "hi", "max_tokens": 2},
            headers={"authorization": "Bearer key-globex"}, timeout=60,
        )  # fmt: skip
        assert neighbour.status_code == 200, neighbour.text
        assert neighbour.json()["choices"][0]["text"] is not None


def test_an_adapters_own_quota_holds_without_touching_its_tenants_other_adapters(server, tiny_adapters) -> None:
    url, _ = server
    body = {"lora_name": "acme-metered", "lora_path": str(tiny_adapters["mlp16"]), "tenant": "acme",
            "quotas": {"tokens_per_minute": 20}}  # fmt: skip
    assert httpx.post(f"{url}/admin/adapters", json=body).json()["quotas"] == {"max_concurrent": None, "tokens_per_minute": 20}
    acme = _client(url, "key-acme")
    acme.completions.create(model="acme-metered", prompt="the quick brown fox", max_tokens=20, extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError, match="adapter 'acme-metered' used its 20 tokens per minute"):
        acme.completions.create(model="acme-metered", prompt="hi", max_tokens=2)
    acme.completions.create(model="acme-bot", prompt="hi", max_tokens=2)  # the tenant's other adapter is not metered
    httpx.post(f"{url}/admin/adapters", json={**body, "quotas": None})  # re-registered without quotas: no limit
    acme.completions.create(model="acme-metered", prompt="hi", max_tokens=2)


def test_every_tenants_token_window_is_pruned(monkeypatch) -> None:
    """A tenant without a token quota is never checked against its window; finishing its
    requests must still drop what is older than the minute, or the window grows without bound."""
    clock = [1000.0]
    monkeypatch.setattr(tenants_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    tenants = Tenants([TenantConfig(name="open-ended", api_keys=["k"])])
    tenant = tenants.authenticate("Bearer k")
    for _ in range(500):
        tenants.admit(tenant, None)
        tenants.finish(tenant, {"adapter": None, "prompt_tokens": 3, "completion_tokens": 4})
        clock[0] += 1.0
    assert len(tenants.usage["tenant:open-ended"].window) <= 61


def test_a_token_reservation_is_released_by_what_the_request_used(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(tenants_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    tenants = Tenants([TenantConfig(name="t", api_keys=["k"], tokens_per_minute=100)])
    tenant = tenants.authenticate("Bearer k")
    first = tenants.admit(tenant, None, 60)
    with pytest.raises(APIError, match="60 reserved by requests in flight"):
        tenants.admit(tenant, None, 60)
    tenants.finish(tenant, {"adapter": None, "prompt_tokens": 5, "completion_tokens": 10}, first)  # stopped early
    second = tenants.admit(tenant, None, 60)  # 15 used + 60 fits in 100
    tenants.finish(tenant, {"adapter": None, "prompt_tokens": 5, "completion_tokens": 55}, second)
    clock[0] += 61  # the minute has passed: a request larger than the whole quota runs alone
    big = tenants.admit(tenant, None, 500)
    with pytest.raises(APIError, match="reserved by requests in flight"):
        tenants.admit(tenant, None, 1)
    tenants.finish(tenant, {"adapter": None, "prompt_tokens": 5, "completion_tokens": 20}, big)
    assert tenants.usage["tenant:t"].reserved == 0


def test_a_tenants_file_with_an_empty_key_is_refused(tmp_path: Path) -> None:
    """A key of nothing would match every request that sends no Authorization header."""
    for bad in ("", "   "):
        (tmp_path / "t.json").write_text(json.dumps({"tenants": [{"name": "a", "api_keys": ["key-a", bad]}]}))
        with pytest.raises(ValueError, match="api_keys"):
            load_tenants(tmp_path / "t.json")


def test_the_tokenizer_routes_are_bounded_as_a_generation_is(server) -> None:
    """``/tokenize`` is tokenizer work on the replica: a prompt past four contexts (or 65,536
    tokens) is a 400 before most of it is encoded (one past the context is still counted, as vLLM
    counts it); its tokens
    count against the tenant's tokens-per-minute quota (and the adapter's), and an adapter's
    served name is a model it takes, as vLLM does."""
    url = server[0]
    acme, counter = {"Authorization": "Bearer key-acme"}, {"Authorization": "Bearer key-counter"}
    base = ENGINES[url].get().base.shape.name
    for model in ("acme-bot", base):
        counted = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "hello there"}, headers=acme)
        assert counted.status_code == 200, counted.text
        back = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": counted.json()["tokens"]}, headers=acme)
        assert back.status_code == 200 and back.json()["prompt"] == "hello there"
    start = time.perf_counter()
    long = httpx.post(f"{url}/tokenize", json={"model": "acme-bot", "prompt": "word " * 400_000}, headers=acme, timeout=30)
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert time.perf_counter() - start < 5, "most of the prompt was not encoded"
    over = httpx.post(f"{url}/tokenize", json={"model": "acme-bot", "prompt": "word " * 400}, headers=acme, timeout=30)
    assert over.status_code == 200 and over.json()["count"] > 256 and over.json()["max_model_len"] == 256
    too_many = httpx.post(f"{url}/detokenize", json={"model": "acme-bot", "tokens": [5] * 65537}, headers=acme)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "tokens"
    # "counter" has 30 tokens a minute: tokenising counts until the quota answers 429.
    answers = [httpx.post(f"{url}/tokenize", json={"model": base, "prompt": "one two three four five six seven"},
                          headers=counter).status_code for _ in range(12)]  # fmt: skip
    assert answers[0] == 200 and 429 in answers
