"""Property-based fuzzing over the server's own OpenAPI schema: any body, well-formed or not, gets
a response below 500 with OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_helpers import tiny_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.serving.api.app import create_app
from loraplane.serving.api.loopback import serve_app

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[tuple[str, dict]]:
    cache = tmp_path_factory.mktemp("fuzz")
    app = create_app(lambda: tiny_engine(tiny_llama, cache, {"qv4": tiny_adapters["qv4"]}, max_model_len=128))
    with serve_app(app) as url:
        yield url, httpx.get(f"{url}/openapi.json").json()


def _bodies(schema: dict, path: str) -> st.SearchStrategy[dict]:
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    fields = list(schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]["properties"])
    plausible = {
        "model": st.sampled_from(["qv4", "missing"]) | st.text(max_size=5),
        "max_tokens": st.integers(-5, 3) | st.integers(10**6, 10**9) | JSON,
        "prompt": st.text(max_size=30) | st.lists(st.integers(-3, 400), max_size=5) | JSON,
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]), "content": st.text(max_size=20)}), max_size=2
        )
        | JSON,
        "stream": st.booleans() | JSON,
    }
    strategies = {f: plausible.get(f, JSON) for f in fields}
    return st.fixed_dictionaries({}, optional={**strategies, "unknown_field": JSON})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_body_makes_a_5xx(server, path: str) -> None:
    url, schema = server

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=_bodies(schema, path))
    def check(body: dict) -> None:
        if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 3 and body.get("stream") is True:
            body["stream"] = False  # keep each example short; streaming is covered elsewhere
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["message"] and error["type"]

    check()
    assert httpx.post(f"{url}/v1/completions", json={"model": "qv4", "prompt": "hi", "max_tokens": 2}).status_code == 200
