"""The admin contract end to end: the server's OpenAPI schema declares the contract's models for
every admin route (no hand-built dicts), and the client the operator and the router use reads a
real replica's answers into them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import tiny_engine
from pydantic import BaseModel

from loraplane.adapter_format import BaseShape
from loraplane.adapter_format.golden import DriftReport
from loraplane.adapter_format.names import INTERNAL_OWNER
from loraplane.admin_api import (
    AdminClient,
    LoadLoraRequest,
    NamedAdapterState,
    Quotas,
    ReplicaError,
    ReplicaStats,
    Tier,
    UnloadLoraRequest,
    VerifyRequest,
)
from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.lora.entries import AdapterSpec
from loraplane.usage import UsageRollup

# (method, path) -> (request model, 200 response model); None where the body is not JSON.
CONTRACT: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel] | None]] = {
    ("post", "/v1/load_lora_adapter"): (LoadLoraRequest, None),
    ("post", "/v1/unload_lora_adapter"): (UnloadLoraRequest, None),
    ("post", "/admin/adapters"): (LoadLoraRequest, NamedAdapterState),
    ("get", "/admin/adapters/{name}"): (None, NamedAdapterState),
    ("post", "/admin/adapters/{name}/pin"): (None, NamedAdapterState),
    ("post", "/admin/adapters/{name}/unpin"): (None, NamedAdapterState),
    ("post", "/admin/adapters/{name}/prefetch"): (None, NamedAdapterState),
    ("post", "/admin/verify"): (VerifyRequest, DriftReport),
    ("get", "/admin/base"): (None, BaseShape),
    ("get", "/admin/usage"): (None, UsageRollup),
    ("get", "/admin/stats"): (None, ReplicaStats),
}


def _no_engine() -> Any:
    raise AssertionError("the schema is read without an engine")


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(_no_engine, admin_token="t").openapi()


def _resolve(openapi: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return openapi["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def _shape(schema: dict[str, Any]) -> tuple[set[str], set[str]]:
    return set(schema.get("properties", {})), set(schema.get("required", []))


def test_every_admin_route_is_in_the_contract(openapi: dict[str, Any]) -> None:
    """A new admin route must name its models here, so it cannot go back to an untyped dict."""
    served = {(m, p) for p, ops in openapi["paths"].items() for m in ops if p.startswith("/admin") or "lora_adapter" in p}
    assert served == set(CONTRACT)


@pytest.mark.parametrize(("method", "path"), sorted(CONTRACT))
def test_the_servers_schema_is_the_contracts_models(openapi: dict[str, Any], method: str, path: str) -> None:
    request, response = CONTRACT[method, path]
    op = openapi["paths"][path][method]
    if request is not None:
        body = _resolve(openapi, op["requestBody"]["content"]["application/json"]["schema"])
        assert _shape(body) == _shape(request.model_json_schema(mode="validation")), f"{method} {path} request"
    if response is not None:
        body = _resolve(openapi, op["responses"]["200"]["content"]["application/json"]["schema"])
        assert _shape(body) == _shape(response.model_json_schema(mode="serialization")), f"{method} {path} response"


def test_replies_from_a_newer_replica_still_read() -> None:
    """The operator and serving images upgrade separately: a field an older reader does not know
    is ignored, not an error."""
    stats = ReplicaStats.model_validate({"adapters": {"a": {"tier": "host", "new_field": 1}}, "new_top": {}})
    assert stats.adapters["a"].tier is Tier.HOST


@pytest.fixture(scope="module")
def replica(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("contract")

    def make():  # type: ignore[no-untyped-def]
        engine = tiny_engine(tiny_llama, cache, max_loras=2)
        engine.register_lora(AdapterSpec("shared", str(tiny_adapters["ku2"])))
        # What a quality gate holds for the seconds of its replay: no served name.
        engine.register_lora(AdapterSpec("candidate-0123456789ab", str(tiny_adapters["qv4"]), tenant=INTERNAL_OWNER))
        return engine

    with serve_app(create_app(make, admin_token="admin", stats_token="stats")) as url:
        yield url


def test_the_client_reads_a_replicas_answers_into_the_models(replica: str, tiny_adapters: dict[str, Path]) -> None:
    async def story() -> None:
        client = AdminClient(replica, "admin")
        quotas = Quotas(tokens_per_minute=500)
        req = LoadLoraRequest(lora_name="acme-bot", lora_path=str(tiny_adapters["qv4"]), tenant="acme", quotas=quotas)
        state = await client.register(req)
        assert (state.name, state.tenant, state.tier, state.quotas) == ("acme-bot", "acme", Tier.COLD, quotas)
        pinned = await client.action("acme-bot", "pin")  # starts its load
        assert pinned.pinned and pinned.tier in (Tier.LOADING, Tier.HOST, Tier.DEVICE)
        for _ in range(300):
            stats = await client.stats()
            if stats.adapters["acme-bot"].tier is not Tier.LOADING:
                break
            await asyncio.sleep(0.1)
        # A candidate under golden replay is not listed: the operator unregisters names nobody claims.
        assert set(stats.adapters) == {"shared", "acme-bot"} and stats.adapters["acme-bot"].quotas == quotas
        assert stats.adapters["acme-bot"].loads == 1 and stats.adapters["acme-bot"].digest is not None
        assert (await client.base()).fingerprint is not None
        assert isinstance(await client.usage(), UsageRollup)
        await client.unregister("acme-bot")
        assert await client.state("acme-bot") is None
        await client.unregister("acme-bot")  # already gone is fine

        with pytest.raises(ReplicaError) as refused:
            await AdminClient(replica, "wrong").stats()
        assert refused.value.status == 401
        with pytest.raises(ReplicaError) as missing:
            await client.action("nobody", "prefetch")
        assert (missing.value.status, missing.value.code) == (404, "model_not_found")
        with pytest.raises(ReplicaError) as down:
            await AdminClient("http://127.0.0.1:9", "admin", timeout=2).stats()
        assert down.value.status is None

    asyncio.run(story())


def test_the_stats_token_reads_the_stats_and_changes_nothing(replica: str, tiny_adapters: dict[str, Path]) -> None:
    """The router's token: a router that leaks it leaks a view of the replica, not its adapters."""

    async def story() -> None:
        reader = AdminClient(replica, "stats")
        assert "shared" in (await reader.stats()).adapters
        req = LoadLoraRequest(lora_name="by-router", lora_path=str(tiny_adapters["qv4"]))
        refused = [
            reader.register(req), reader.action("shared", "pin"), reader.action("shared", "prefetch"),
            reader.unregister("shared"), reader.state("shared"), reader.base(), reader.usage(),
        ]  # fmt: skip
        for call in refused:
            with pytest.raises(ReplicaError) as err:
                await call
            assert err.value.status == 401
        assert await AdminClient(replica, "admin").state("shared") is not None  # still there
        assert await AdminClient(replica, "admin").state("by-router") is None

    asyncio.run(story())
