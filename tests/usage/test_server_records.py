"""The server's usage records through the official client: one per request, under the id the
client saw, with the tokens it was told; aborted and refused requests recorded as such; the
report's totals equal the Prometheus counters' increase; tenants' rollups on /admin/usage."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from engine_helpers import tiny_engine

from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import TenantConfig, Tenants
from loraplane.usage import Metering
from loraplane.usage.report import build_report
from loraplane.usage.spool import closed_segments

ADMIN = "admin-secret"
TENANTS = [
    TenantConfig(name="acme", api_keys=["key-acme"]),
    TenantConfig(name="solo", api_keys=["key-solo"], tokens_per_minute=10),
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[tuple[str, Path, Metering]]:
    root = tmp_path_factory.mktemp("usage-server")
    metering = Metering.create("pod-a", root / "spool", fsync_interval=0.05)
    adapters = {"qv4": tiny_adapters["qv4"]}
    app = create_app(
        lambda: tiny_engine(tiny_llama, root / "cache", adapters, max_model_len=256),
        admin_token=ADMIN, tenants=Tenants(TENANTS), metering=metering,
    )  # fmt: skip
    with serve_app(app) as url:
        yield url, root / "spool", metering


def records(spool: Path, metering: Metering) -> dict[str, dict[str, object]]:
    """Every record written so far: what the open segment holds plus the closed ones."""
    out = {}
    for path in [*closed_segments(spool), *spool.glob("*.jsonl.open")]:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[r["request_id"]] = r
    return out


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_each_request_is_recorded_under_the_id_and_tokens_the_client_saw(server) -> None:
    url, spool, metering = server
    acme = client(url, "key-acme")
    plain = acme.completions.create(model="qv4", prompt="the quick brown fox", max_tokens=6, temperature=0)
    # Written before the response was sent: no waiting needed.
    r = records(spool, metering)[plain.id]
    assert (r["prompt_tokens"], r["completion_tokens"]) == (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    assert (r["tenant"], r["adapter"], r["outcome"], r["replica"]) == ("acme", "qv4", "completed", "pod-a")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", str(r["adapter_digest"]))
    assert r["ttft_seconds"] is not None and 0 < r["ttft_seconds"] <= r["duration_seconds"]
    chunks = list(acme.chat.completions.create(
        model="qv4", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    usage = chunks[-1].usage
    r = records(spool, metering)[chunks[0].id]
    assert (r["prompt_tokens"], r["completion_tokens"], r["endpoint"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
        "/v1/chat/completions",
    )


def test_a_client_that_hangs_up_is_recorded_as_aborted(server) -> None:
    url, spool, metering = server
    body = {"model": "qv4", "prompt": "count with me", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer key-acme"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    rid = json.loads(first.removeprefix("data: "))["id"]
    deadline = time.monotonic() + 30
    while rid not in records(spool, metering) and time.monotonic() < deadline:
        time.sleep(0.05)
    r = records(spool, metering)[rid]
    assert r["outcome"] == "aborted" and 1 <= int(r["completion_tokens"]) < 200  # type: ignore[call-overload]


def test_a_quota_refusal_is_recorded_once_as_refused(server) -> None:
    url, spool, metering = server
    solo = client(url, "key-solo")
    base = solo.models.list().data[0].id
    used = solo.completions.create(model=base, prompt="the quick brown fox", max_tokens=8, extra_body={"ignore_eos": True})
    assert used.usage.total_tokens > 10
    with pytest.raises(openai.RateLimitError):
        solo.completions.create(model=base, prompt="again", max_tokens=8)
    refused = [r for r in records(spool, metering).values() if r["tenant"] == "solo" and r["outcome"] == "refused"]
    assert len(refused) == 1 and refused[0]["status_code"] == 429 and refused[0]["completion_tokens"] == 0
    assert records(spool, metering)[used.id]["outcome"] == "completed"


def _counter_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.MULTILINE))


def test_report_totals_equal_the_prometheus_counters_increase(server) -> None:
    url, spool, metering = server
    admin = {"Authorization": f"Bearer {ADMIN}"}
    # The series name every tenant's adapters: on a server with tenants only the admin token reads them.
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer key-acme"}).status_code == 401
    before_text = httpx.get(f"{url}/metrics", headers=admin).text
    before = set(records(spool, metering))
    acme = client(url, "key-acme")
    for i in range(6):
        acme.completions.create(model="qv4", prompt=f"item {i} of the list", max_tokens=3 + i, temperature=0)
    after_text = httpx.get(f"{url}/metrics", headers=admin).text
    new = {k: v for k, v in records(spool, metering).items() if k not in before}
    blob = "\n".join(json.dumps(r) for r in new.values()).encode()
    report = build_report([("new", blob)])
    for counter, field in (("loraplane_prompt_tokens", "prompt_tokens"), ("loraplane_generation_tokens", "completion_tokens"),
                           ("loraplane_requests", "requests")):  # fmt: skip
        increase = _counter_sum(after_text, counter) - _counter_sum(before_text, counter)
        assert increase == sum(getattr(r, field) for r in report.rows), counter


def test_admin_usage_rolls_up_per_tenant(server) -> None:
    url, _, _ = server
    assert httpx.get(f"{url}/admin/usage").status_code == 401
    body = httpx.get(f"{url}/admin/usage", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    tenants = {t["tenant"]: t for t in body["tenants"]}
    assert body["replica"] == "pod-a" and tenants["acme"]["requests"] >= 9
    assert (tenants["solo"]["refused"], tenants["solo"]["requests"]) == (1, 1)
    assert tenants["acme"]["completion_tokens"] > 0
