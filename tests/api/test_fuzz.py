"""Hostile requests drawn from the server's own OpenAPI schema, while another tenant streams.

Bodies come from Schemathesis over the OpenAPI schema the running server publishes in
``/openapi.json`` (so a new field is fuzzed the day it is added): bodies the schema allows and
bodies it refuses, then up to three fields (or the model name, or an unknown field) replaced with
extremes: numbers past every bound and type, huge lists, long and NUL-filled strings, nesting.
Each goes to a replica with tenants, and to the router in front of it, while the other tenant
streams one fixed-length answer after another. Each hostile request must get a 4xx in OpenAI's
error shape or a correct answer; every one of the other tenant's streams must complete every
token; the server must stay ready.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from engine_helpers import tiny_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import TenantConfig, Tenants
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.serving.router.app import create_router_app
from loraplane.serving.router.config import RouterConfig

ADMIN = "fuzz-admin-token"
TENANTS = [
    TenantConfig(name="steady", api_keys=["key-steady"]),
    TenantConfig(name="hostile", api_keys=["key-hostile"]),
]
STEADY_TOKENS = 48
EXTREMES = st.sampled_from([
    2**64, -(2**63) - 1, 10**30, -1, 0, 1e308, -1e308, 5e-324, 1e-40, 2**53 + 1,
    "", "\x00" * 1000, "x" * 200_000, "ü" * 50_000,
    [0] * 20_000, [10**12] * 100, [[1] * 64] * 200, ["s"] * 5_000, [{}] * 1_000,
    {"a": {"b": {"c": {"d": [None]}}}}, {str(i): i for i in range(2_000)},
    True, None,
])  # fmt: skip


def hostile_bodies(openapi: dict[str, Any], path: str, models: list[str]) -> st.SearchStrategy[Any]:
    operation = schemathesis.openapi.from_dict(openapi)[path]["POST"]
    cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode))
    # A refused body may be raw bytes (sent as they are) or absent (sent as JSON null).
    bodies = cases.map(lambda case: case.body if isinstance(case.body, dict | list | str | int | float | bool | bytes) else None)
    fields = [*openapi["components"]["schemas"][_request_model(openapi, path)]["properties"], "unknown_field"]
    extremes = st.just({}) | st.dictionaries(st.sampled_from(fields), EXTREMES, min_size=1, max_size=3)
    # Half the bodies are the generated ones whole; the other half keep one to three of their
    # fields over a short request that runs (a prompt, a few tokens, a choice or two), so that the
    # engine, not only validation, meets what the schema allows.
    short = {"max_tokens": 4, "n": 1, **({"prompt": "hi"} if path == "/v1/completions" else
                                          {"messages": [{"role": "user", "content": "hi"}]})}  # fmt: skip
    kept = st.none() | st.sets(st.sampled_from(fields), min_size=1, max_size=3)

    def hostile(body: Any, model: str, keep: set[str] | None, extra: dict[str, Any]) -> Any:
        # A body the schema refuses may not be an object at all; an object gets a model worth
        # reaching (the base, each tenant's adapter, a missing one) before the extremes.
        if not isinstance(body, dict):
            return body
        if keep is not None:
            body = {**short, **{k: v for k, v in body.items() if k in keep}}
        return {**body, "model": model, **extra}

    return st.builds(hostile, bodies, st.sampled_from(models), kept, extremes)


def _request_model(openapi: dict[str, Any], path: str) -> str:
    ref: str = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return ref.rsplit("/", 1)[-1]


class SteadyTenant:
    """Streams one ``STEADY_TOKENS``-token answer after another until stopped, noting any answer
    that fell short or carried an error."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.completed = 0
        self.broken: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SteadyTenant:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "a steady answer", "max_tokens": STEADY_TOKENS, "ignore_eos": True,
                "stream": True, "temperature": 0.7, "seed": 3, "stream_options": {"include_usage": True}}  # fmt: skip
        while not self._stop.is_set():
            usage, errors = None, []
            try:
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120,
                                  headers={"Authorization": "Bearer key-steady"}) as r:  # fmt: skip
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line.removeprefix("data: "))
                            errors += [event["error"]["message"]] if "error" in event else []
                            usage = event.get("usage") or usage
            except httpx.HTTPError as err:
                self.broken.append(repr(err))
                continue
            if r.status_code != 200 or errors or not usage or usage["completion_tokens"] != STEADY_TOKENS:
                self.broken.append(f"{r.status_code} {errors} {usage}")
            else:
                self.completed += 1


def check_answer(r: httpx.Response, body: dict[str, Any]) -> None:
    """A 4xx in OpenAI's error shape, or a whole answer: a stream that ends with [DONE] and no
    error event, or a body with choices and consistent usage."""
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text[:500]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.split("\n") if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", r.text[-500:]
        assert not any(line.startswith('data: {"error"') for line in lines), r.text[-500:]
        return
    answer = r.json()
    usage = answer["usage"]
    assert answer["choices"] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A replica with tenants, and the router in front of it."""
    cache = tmp_path_factory.mktemp("fuzz")

    def make():  # type: ignore[no-untyped-def]
        engine = tiny_engine(tiny_llama, cache, max_model_len=128)
        engine.register_lora(AdapterSpec("hostile-bot", str(tiny_adapters["qv4"]), tenant="hostile"))
        engine.register_lora(AdapterSpec("steady-bot", str(tiny_adapters["all8"]), tenant="steady"))
        return engine

    with serve_app(create_app(make, tenants=Tenants(TENANTS), admin_token=ADMIN)) as replica:
        config = RouterConfig(replicas=[replica], stats_interval=0.3)
        with serve_app(create_router_app(config, tenants=Tenants(TENANTS), admin_token=ADMIN)) as router:
            yield {
                "replica": replica,
                "router": router,
                "openapi": httpx.get(f"{replica}/openapi.json").json(),
                "models": [tiny_llama.name, "hostile-bot", "steady-bot", "missing-bot"],
            }


@pytest.mark.parametrize("target", ["replica", "router"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_bodies_fail_alone_while_another_tenant_streams(stack: dict[str, Any], target: str, path: str) -> None:
    url = stack[target]
    headers = {"Authorization": "Bearer key-hostile", "Content-Type": "application/json"}
    hostile = httpx.Client(base_url=url, headers=headers, timeout=120)

    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=hostile_bodies(stack["openapi"], path, stack["models"]))
    def check(body: Any) -> None:
        r = hostile.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
        check_answer(r, body)

    with SteadyTenant(url, "steady-bot") as steady:
        check()
    assert not steady.broken, steady.broken
    assert steady.completed >= 1
    assert httpx.get(f"{url}/ready").status_code == 200


ADMIN_ROUTES = ["/admin/adapters", "/admin/verify", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
# 40 per route in `make test`; a longer run: LORAPLANE_API_FUZZ_EXAMPLES=500 (docs/security.md).
ADMIN_EXAMPLES = int(os.environ.get("LORAPLANE_API_FUZZ_EXAMPLES", "40"))


def admin_bodies(openapi: dict[str, Any], path: str, paths: list[str]) -> st.SearchStrategy[Any]:
    """The admin routes' bodies as the schema draws them, with extremes in up to three fields and,
    often, a name and a path worth reaching (a real adapter, a broken one, a file, nothing there)."""
    operation = schemathesis.openapi.from_dict(openapi)[path]["POST"]
    cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode))
    bodies = cases.map(lambda case: case.body if isinstance(case.body, dict | list | str | int | float | bool | bytes) else None)
    fields = [*openapi["components"]["schemas"][_request_model(openapi, path)]["properties"], "unknown_field"]
    extremes = st.just({}) | st.dictionaries(st.sampled_from(fields), EXTREMES, min_size=1, max_size=3)

    def hostile(body: Any, name: str | None, where: str | None, extra: dict[str, Any]) -> Any:
        if not isinstance(body, dict):
            return body
        body = {**body, **({"lora_name": name} if name else {}), **({"lora_path": where} if where else {}), **extra}
        if body.get("lora_name") == "steady-bot":  # the one name the steady tenant needs
            body["lora_name"] = "hostile-bot"
        return body

    names = st.none() | st.sampled_from(["hostile-bot", "fuzz-a", "fuzz-b"])
    return st.builds(hostile, bodies, names, st.none() | st.sampled_from(paths), extremes)


@pytest.mark.parametrize("path", ADMIN_ROUTES)
def test_hostile_admin_bodies_fail_alone_while_another_tenant_streams(
    stack: dict[str, Any], tiny_adapters: dict[str, Path], tmp_path: Path, path: str
) -> None:
    """The admin caller is trusted to act, not to be careful: whatever body it sends gets a 4xx
    in OpenAI's error shape or a 2xx, and the other tenant's streams go on."""
    url = stack["replica"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    paths = [str(tiny_adapters["ku2"]), str(broken), str(tmp_path / "absent"), "/etc/hostname", f"file://{tiny_adapters['qv4']}"]
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
                         timeout=120)  # fmt: skip

    @settings(max_examples=ADMIN_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=admin_bodies(stack["openapi"], path, paths))
    def check(body: Any) -> None:
        r = admin.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
        assert r.status_code < 500, (body if not isinstance(body, bytes) else body[:200], r.status_code, r.text[:500])
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["message"] and error["type"], r.text[:500]

    with SteadyTenant(url, "steady-bot") as steady:
        check()
    assert not steady.broken, steady.broken
    assert steady.completed >= 1
    assert httpx.get(f"{url}/ready").status_code == 200
