"""The router in front of three real serving replicas (child processes, tiny model) on loopback:
affinity, the load bound under one hot adapter, streaming and tenants through it, discovery from
EndpointSlices, and a replica killed under load."""

from __future__ import annotations

import asyncio
import math
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from envtest import control_plane, node_address
from fastapi import FastAPI, Request  # at module level: FastAPI resolves the routes' annotations here
from impostors import copying_app

from loraplane.admin_api.auth import SignedResponses, tokens_carried
from loraplane.serving.bench.deployment import Fleet, spawn_replicas
from loraplane.serving.config import EngineConfig
from loraplane.serving.http.loopback import free_port, serve_app
from loraplane.serving.http.tenants import Tenants, load_tenants
from loraplane.serving.lora.merge import merge_adapter
from loraplane.serving.router.app import create_router_app
from loraplane.serving.router.config import RouterConfig
from loraplane.serving.weights.base import resolve_base

OWNERS = {"qv4": "acme", "all8": "acme", "mlp16": "globex", "ku2": "globex"}
EPSILON = 0.25


@pytest.fixture(scope="module")
def fleet(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    config = EngineConfig(
        model=str(tiny_llama), dtype="float32", cache_dir=tmp_path_factory.mktemp("replica-cache"), max_loras=2,
        max_cpu_loras=4, max_lora_rank=16, block_size=4, num_kv_blocks=256, max_num_seqs=2,
    )  # fmt: skip
    adapters = {name: (tiny_adapters[name], owner) for name, owner in OWNERS.items()}
    # On this machine's own address, not loopback: the discovery test publishes them in EndpointSlices.
    with spawn_replicas(config, adapters, ["acme", "globex"], 3, start_timeout=180, host=node_address()) as f:
        yield f


def router_for(fleet: Fleet, tenants: Tenants | None = None, **config: Any) -> Any:
    tenants = tenants or Tenants(load_tenants(fleet.work / "tenants.yaml"))
    settings = RouterConfig(**{"replicas": fleet.urls, "stats_interval": 0.3, "epsilon": EPSILON, **config})
    return serve_app(create_router_app(settings, tenants=tenants, admin_token=fleet.admin_token))


@pytest.fixture(scope="module")
def router(fleet: Fleet) -> Iterator[str]:
    with router_for(fleet) as url:
        yield url


def name_of(url: str) -> str:
    return url.removeprefix("http://")


def replica_stats(fleet: Fleet, url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {fleet.admin_token}"}, timeout=30)
    r.raise_for_status()
    result: dict[str, Any] = r.json()
    return result


def table(fleet: Fleet, router: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{router}/router/replicas", headers={"Authorization": f"Bearer {fleet.admin_token}"}, timeout=30)
    r.raise_for_status()
    return {rep["name"]: rep for rep in r.json()["replicas"]}


def complete(router: str, key: str, model: str, **body: Any) -> httpx.Response:
    payload = {"model": model, "prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{router}/v1/completions", json=payload, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_affinity_sends_an_adapters_requests_back_to_the_replica_that_holds_it(fleet: Fleet, router: str) -> None:
    key = fleet.keys["acme"]
    for model in ("qv4", "all8"):
        served = []
        for _ in range(6):
            r = complete(router, key, model)
            assert r.status_code == 200, r.text
            served.append(r.headers["x-loraplane-replica"])
        assert len(set(served)) == 1, served
        home = served[0]
        # The replicas agree: only the home saw the adapter, cold once, then on its device.
        for url in fleet.urls:
            figures = replica_stats(fleet, url)["adapters"][model]
            if name_of(url) == home:
                assert (figures["requests"], figures["cold_loads"], figures["device_hits"]) == (6, 1, 5)
            else:
                assert figures["requests"] == 0


def test_one_hot_adapter_spreads_over_replicas_within_the_load_bound(fleet: Fleet, router: str) -> None:
    key, burst = fleet.keys["globex"], 24

    async def one(client: httpx.AsyncClient) -> str:
        body = {"model": "ku2", "prompt": "hot adapter", "max_tokens": 64, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{router}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_bytes():
                pass
            return r.headers["x-loraplane-replica"]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
            return await asyncio.gather(*(one(client) for _ in range(burst)))

    counts = Counter(asyncio.run(all_at_once()))
    bound = math.ceil((1 + EPSILON) * burst / len(fleet.urls))  # the busiest replica when the last one arrived
    assert max(counts.values()) <= bound, counts
    assert len(counts) == len(fleet.urls), counts  # the heat overflowed to every replica


def test_streams_pass_through_and_tenants_stay_apart_at_the_edge(fleet: Fleet, router: str) -> None:
    globex = openai.OpenAI(base_url=f"{router}/v1", api_key=fleet.keys["globex"], max_retries=0)
    direct = openai.OpenAI(base_url=f"{fleet.urls[0]}/v1", api_key=fleet.keys["globex"], max_retries=0)
    ask = {"model": "mlp16", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
    direct_chunks = direct.chat.completions.create(**ask, stream=True, extra_body={"ignore_eos": True})
    expected = [c.choices[0].delta.content or "" for c in direct_chunks if c.choices]
    chunks = list(globex.chat.completions.create(**ask, stream=True, extra_body={"ignore_eos": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert pieces == expected  # the same events, one by one
    assert sum(1 for p in pieces if p) > 1  # token by token, not one buffered blob
    assert all(c.usage is None for c in chunks)  # the usage chunk the router asked for stays with it
    usage_asked = {"stream": True, "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    with_usage = list(globex.chat.completions.create(**ask, **usage_asked))
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 8
    with pytest.raises(openai.NotFoundError):  # acme's adapter does not exist for globex
        globex.completions.create(model="qv4", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):  # refused at the edge
        openai.OpenAI(base_url=f"{router}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert {m.id for m in globex.models.list().data} >= {"mlp16", "ku2"}
    assert not {"qv4", "all8"} & {m.id for m in globex.models.list().data}
    # vLLM's tokenizer routes go through too, with the same keys and the same hiding.
    key = {"Authorization": f"Bearer {fleet.keys['globex']}"}
    counted = httpx.post(f"{router}/tokenize", json={"model": "mlp16", "prompt": "hello"}, headers=key, timeout=30).json()
    assert counted == httpx.post(f"{fleet.urls[0]}/tokenize", json={"model": "mlp16", "prompt": "hello"}, headers=key).json()
    back = httpx.post(f"{router}/detokenize", json={"model": "mlp16", "tokens": counted["tokens"]}, headers=key, timeout=30)
    assert back.json()["prompt"].endswith("hello")
    assert httpx.post(f"{router}/tokenize", json={"model": "qv4", "prompt": "x"}, headers=key, timeout=30).status_code == 404
    assert httpx.post(f"{router}/tokenize", json={"model": "mlp16", "prompt": "x"}, timeout=30).status_code == 401
    assert httpx.get(f"{router}/version", timeout=30).json()["version"]


def test_a_tenants_concurrency_quota_holds_at_the_edge(fleet: Fleet) -> None:
    tenants = load_tenants(fleet.work / "tenants.yaml")
    limited = [t.model_copy(update={"max_concurrent": 1}) if t.name == "acme" else t for t in tenants]
    with router_for(fleet, Tenants(limited)) as url:
        headers = {"Authorization": f"Bearer {fleet.keys['acme']}"}
        # Long enough to be still running when the second request arrives: a router forwards a
        # stream at the replica's pace whether or not its client reads (32 tokens once ended first).
        body = {"model": "qv4", "prompt": "hold on", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as first:
            assert first.status_code == 200
            second = complete(url, fleet.keys["acme"], "qv4")
            assert second.status_code == 429 and second.headers["retry-after"]
            assert second.json()["error"]["code"] == "concurrency_limit"
            assert complete(url, fleet.keys["globex"], "ku2").status_code == 200  # another tenant is not slowed
            for _ in first.iter_bytes():
                pass
        assert complete(url, fleet.keys["acme"], "qv4").status_code == 200


def test_the_tokenizer_routes_count_against_a_tenants_quota_at_the_edge(fleet: Fleet) -> None:
    """Tokenising is a replica's CPU time: the edge holds the tenant's quota for it as for a
    generation, so a tenant over its tokens per minute keeps no replica busy tokenising."""
    tenants = load_tenants(fleet.work / "tenants.yaml")
    limited = [t.model_copy(update={"tokens_per_minute": 30}) if t.name == "acme" else t for t in tenants]
    with router_for(fleet, Tenants(limited)) as url:
        acme = {"Authorization": f"Bearer {fleet.keys['acme']}"}
        body = {"model": "qv4", "prompt": "one two three four five six seven eight"}
        answers = [httpx.post(f"{url}/tokenize", json=body, headers=acme, timeout=30).status_code for _ in range(10)]
        assert answers[0] == 200 and answers[-1] == 429, answers
        globex = {"Authorization": f"Bearer {fleet.keys['globex']}"}
        assert httpx.post(f"{url}/tokenize", json={**body, "model": "ku2"}, headers=globex, timeout=30).status_code == 200


def test_the_edge_validates_like_a_replica_and_hides_other_tenants_adapters_before_quotas(fleet: Fleet) -> None:
    tenants = load_tenants(fleet.work / "tenants.yaml")
    limited = [t.model_copy(update={"tokens_per_minute": 30}) if t.name == "acme" else t for t in tenants]
    with router_for(fleet, Tenants(limited)) as url:
        acme, globex = fleet.keys["acme"], fleet.keys["globex"]
        # "stream": 1 is a 400 naming the field at the edge, as at a replica (OpenAI's types, not
        # coerced), and counts nothing; a stream's tokens count as a plain answer's.
        body = {"model": "qv4", "prompt": "count me", "max_tokens": 30, "ignore_eos": True, "stream": 1}
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {acme}"}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, headers={"Authorization": f"Bearer {acme}"},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.text.startswith("data: ")
        assert complete(url, acme, "qv4").status_code == 429  # its 30+ tokens were counted
        bad = httpx.post(f"{url}/v1/completions", json={"model": "ku2", "prompt": "x", "temperature": 9},
                         headers={"Authorization": f"Bearer {globex}"}, timeout=30)  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        # acme is over its quota, yet globex's adapter is still "not found" for acme, not "429",
        # and so is a name no replica serves: the two cannot be told apart.
        assert complete(url, acme, "ku2").status_code == 404
        assert complete(url, acme, "no-such-adapter").status_code == 404
        assert complete(url, globex, "ku2").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_api_goes_through_and_its_tokens_count(fleet: Fleet, stream: bool) -> None:
    """``/v1/responses`` is checked at the edge, forwarded, relayed event by event, and its
    tokens (the Responses API's ``input_tokens`` and ``output_tokens``, in the last event when
    streamed) count against the tenant's quota as a chat completion's do."""
    tenants = load_tenants(fleet.work / "tenants.yaml")
    limited = [t.model_copy(update={"tokens_per_minute": 30}) if t.name == "acme" else t for t in tenants]
    with router_for(fleet, Tenants(limited)) as url:
        acme = openai.OpenAI(base_url=f"{url}/v1", api_key=fleet.keys["acme"], max_retries=0)
        direct = openai.OpenAI(base_url=f"{fleet.urls[0]}/v1", api_key=fleet.keys["acme"], max_retries=0)
        ask = {"model": "qv4", "input": "hello", "max_output_tokens": 30, "temperature": 0, "extra_body": {"ignore_eos": True}}
        expected = direct.responses.create(**ask).output_text
        if stream:
            events = list(acme.responses.create(stream=True, **ask))
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
            assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 30
        else:
            assert acme.responses.create(**ask).output_text == expected
        assert complete(url, fleet.keys["acme"], "qv4").status_code == 429  # its 30+ tokens were counted
        with pytest.raises(openai.BadRequestError):  # checked at the edge as at a replica, before the quota
            acme.responses.create(model="qv4", input="x", truncation="auto")


def test_stored_responses_are_reached_at_the_replica_that_keeps_them(fleet: Fleet, router: str) -> None:
    """Replicas keep their stored responses: a request going on from one reaches the replica that
    keeps it, whatever the routing policy would choose (round-robin here), streamed or not;
    reading and deleting it too. A router that never saw the id (another one, or restarted)
    finds it by asking. Another tenant's key finds nothing."""
    acme, globex = fleet.keys["acme"], fleet.keys["globex"]
    headers = {"Authorization": f"Bearer {acme}"}
    going_on = {"model": "qv4", "input": "and then?", "max_output_tokens": 3}
    with router_for(fleet, policy="round-robin") as spread:
        first = httpx.post(f"{spread}/v1/responses", headers=headers, json={**going_on, "input": "hello"}, timeout=120)
        assert first.status_code == 200, first.text
        home, rid = first.headers["x-loraplane-replica"], first.json()["id"]
        going_on["previous_response_id"] = rid
        for stream in (False, True, False, True):
            r = httpx.post(f"{spread}/v1/responses", headers=headers, json={**going_on, "stream": stream}, timeout=120)
            assert r.status_code == 200 and r.headers["x-loraplane-replica"] == home, r.text
        plain = [complete(spread, acme, "qv4").headers["x-loraplane-replica"] for _ in range(3)]
        assert len(set(plain)) == 3  # without a stored response to go on from, the policy spreads them
    with router_for(fleet) as fresh:  # has never seen the id
        client = openai.OpenAI(base_url=f"{fresh}/v1", api_key=acme, max_retries=0)
        assert client.responses.retrieve(rid).id == rid
        assert [i.content[0].text for i in client.responses.input_items.list(rid).data] == ["hello"]
        after = client.responses.create(**going_on)
        assert after.previous_response_id == rid
        assert client.responses.retrieve(after.id).output_text == after.output_text
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=f"{fresh}/v1", api_key=globex, max_retries=0).responses.retrieve(rid)
    client = openai.OpenAI(base_url=f"{router}/v1", api_key=acme, max_retries=0)
    client.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**going_on)


def test_a_replica_that_answers_garbage_does_not_stop_the_upkeep(fleet: Fleet) -> None:
    """A holder of the token (its answers signed) whose stats do not parse: a replica of another
    version, or a broken one. It is down, and the others go on."""
    from fastapi.responses import PlainTextResponse

    garbage = FastAPI()
    garbage.add_middleware(SignedResponses)

    @garbage.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @garbage.get("/admin/stats")
    async def stats(request: Request) -> PlainTextResponse:
        assert await tokens_carried(request, [fleet.admin_token])
        return PlainTextResponse("<html>not json</html>", media_type="application/json")

    with serve_app(garbage) as bad_url, router_for(fleet, replicas=[bad_url, *fleet.urls]) as url:
        seen_down = False
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not seen_down:  # several upkeep rounds
            bad = table(fleet, url)[name_of(bad_url)]
            seen_down = not bad["up"] and "unreadable" in (bad["error"] or "")
            time.sleep(0.1)
        assert seen_down, bad["error"]
        view = table(fleet, url)
        assert all(view[name_of(u)]["up"] and view[name_of(u)]["registered"] == len(OWNERS) for u in fleet.urls)
        assert complete(url, fleet.keys["acme"], "qv4").status_code == 200


def test_a_pod_posing_as_a_replica_is_never_sent_a_prompt(fleet: Fleet) -> None:
    """A pod that joins the serving Service by wearing its labels, and answers the stats call with
    a real replica's answer (its signature header included): it does not hold the token, so it
    cannot sign the answer to the router's call. It is never up, and it receives no prompt."""
    real = httpx.get(f"{fleet.urls[0]}/admin/stats", headers={"Authorization": f"Bearer {fleet.admin_token}"}, timeout=30)
    prompts: list[str] = []
    impostor = copying_app("/ready", "/admin/stats", real)

    @impostor.post("/v1/completions")
    async def completions(request: Request) -> dict[str, str]:
        prompts.append((await request.json())["prompt"])
        return {"id": "stolen"}

    with serve_app(impostor) as rogue_url, router_for(fleet, replicas=[rogue_url, *fleet.urls]) as url:
        for _ in range(12):  # the hash would send some of these to a fourth replica
            r = complete(url, fleet.keys["acme"], "qv4", prompt=f"secret {_}", user=f"u{_}")
            assert r.status_code == 200 and r.json()["id"] != "stolen", r.text
        rogue = table(fleet, url)[name_of(rogue_url)]
        assert not rogue["up"] and "not a replica of this base" in rogue["error"], rogue
        assert rogue["registered"] == 0
    assert prompts == []


def test_replicas_are_discovered_from_the_services_endpointslices(fleet: Fleet, tmp_path: Path) -> None:
    from kubernetes import config as kube_config

    def endpoint_slice(name: str, service: str, url: str) -> dict[str, Any]:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
            "endpoints": [{"addresses": [host], "conditions": {"ready": True},
                           "targetRef": {"kind": "Pod", "name": f"serving-{name}", "namespace": "default"}}],
        }  # fmt: skip

    with control_plane(tmp_path / "kube") as kube:
        kube.apply(endpoint_slice("a", "tiny-serving", fleet.urls[0]))
        kube.apply(endpoint_slice("b", "tiny-serving", fleet.urls[1]))
        kube.apply(endpoint_slice("other", "someone-else", fleet.urls[2]))
        api = kube_config.new_client_from_config(config_file=str(kube.kubeconfig))
        settings = RouterConfig(service="tiny-serving", namespace="default", stats_interval=0.3)
        app = create_router_app(settings, tenants=Tenants(load_tenants(fleet.work / "tenants.yaml")),
                                admin_token=fleet.admin_token, kube_api_client=api)  # fmt: skip
        with serve_app(app) as url:
            kube.wait_for("both replicas", lambda: set(table(fleet, url)) == {"serving-a", "serving-b"}, timeout=20)
            assert complete(url, fleet.keys["acme"], "all8").status_code == 200
            # With tenants the router's series (per replica, per tenant) are for the admin token only.
            assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {fleet.keys['acme']}"}).status_code == 401
            admin = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {fleet.admin_token}"})
            assert admin.status_code == 200 and "loraplane_router_requests_total" in admin.text
            kube.apply(endpoint_slice("c", "tiny-serving", fleet.urls[2]))
            kube.wait_for("the new one", lambda: "serving-c" in table(fleet, url), timeout=20)
            kube.delete("EndpointSlice", "default", "a")
            kube.wait_for("the removal", lambda: set(table(fleet, url)) == {"serving-b", "serving-c"}, timeout=20)


def test_a_dedicated_replica_takes_its_adapters_requests_and_gives_them_back_when_gone(
    fleet: Fleet, tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A replica serving ``qv4`` merged into the base (``loraplane merge``; named ``qv4``) joins the
    router's members: ``qv4``'s requests go to it and answer as the adapter does on the shared
    replicas; nothing else goes to it; the edge still hides ``qv4`` from another tenant; killed
    under steady traffic, it fails no request (they go back to the shared replicas, where ``qv4``
    stays registered)."""
    merged = merge_adapter(resolve_base(str(tiny_llama), tmp_path / "cache"), tiny_adapters["qv4"], tmp_path / "merged")
    work = tmp_path / "dedicated"
    work.mkdir()
    shutil.copy(fleet.work / "tenants.yaml", work / "tenants.yaml")
    config = EngineConfig(
        model=str(merged.folder), base_name="qv4", dtype="float32", cache_dir=tmp_path / "dedicated-cache", max_loras=1,
        max_lora_rank=16, block_size=4, num_kv_blocks=256, max_num_seqs=2,
    )  # fmt: skip
    (work / "engine.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    dedicated = Fleet([free_port()], {}, fleet.keys, fleet.admin_token, fleet.tenant_names, work, host=fleet.host)
    dedicated.start(0)
    try:
        dedicated.ready(0, timeout=180)
        (dedicated_url,) = dedicated.urls
        acme = fleet.keys["acme"]
        on_shared = complete(fleet.urls[0], acme, "qv4").json()["choices"][0]["text"]
        with router_for(fleet, replicas=[*fleet.urls, dedicated_url]) as router:
            deadline = time.monotonic() + 30
            while table(fleet, router)[name_of(dedicated_url)]["dedicated_model"] != "qv4":
                assert time.monotonic() < deadline
                time.sleep(0.2)

            def served_there() -> int:
                return sum(c["requests"] for c in replica_stats(dedicated, dedicated_url)["tenants"].values())

            answer = complete(router, acme, "qv4")
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == on_shared
            assert served_there() == 1
            for model in ("all8", "qv4-nope"):
                complete(router, acme, model)
            base = httpx.get(f"{router}/v1/models", headers={"Authorization": f"Bearer {acme}"}, timeout=30).json()
            assert {m["id"] for m in base["data"]} >= {"qv4", "all8"}  # the shared replicas' list, not the merged one's
            assert served_there() == 1  # nothing else went there
            assert complete(router, fleet.keys["globex"], "qv4").status_code == 404  # acme's, at the edge
            failures: list[str] = []
            stop = threading.Event()

            def traffic() -> None:
                while not stop.is_set():
                    r = complete(router, acme, "qv4")
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text}")

            thread = threading.Thread(target=traffic)
            thread.start()
            time.sleep(1.0)
            dedicated.kill(0)
            time.sleep(2.0)
            stop.set()
            thread.join(60)
            assert failures == []
            assert complete(router, acme, "qv4").json()["choices"][0]["text"] == on_shared  # from the shared replicas
            metrics = httpx.get(f"{router}/metrics", headers={"Authorization": f"Bearer {fleet.admin_token}"}).text
            routed = [line for line in metrics.splitlines() if line.startswith("loraplane_router_requests_total{")]
            assert any('decision="dedicated"' in line and name_of(dedicated_url) in line for line in routed), routed
    finally:
        dedicated.stop()


def test_killing_a_replica_loses_no_request_that_had_not_started_streaming(fleet: Fleet, router: str) -> None:
    key, burst = fleet.keys["acme"], 12
    started: list[bool] = [False] * burst

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        try:
            stream = await client.completions.create(
                model="all8", prompt="a long answer", max_tokens=48, stream=True, extra_body={"ignore_eos": True}
            )
            async for _ in stream:
                started[i] = True
            return None
        except openai.APIError as err:
            return repr(err)

    async def scenario() -> tuple[list[str | None], str]:
        client = openai.AsyncOpenAI(base_url=f"{router}/v1", api_key=key, max_retries=0, timeout=300)
        tasks = [asyncio.create_task(one(client, i)) for i in range(burst)]
        deadline = time.monotonic() + 60
        while True:  # wait until one replica holds requests that are still queued there
            state = await asyncio.to_thread(table, fleet, router)
            busiest = max(state.values(), key=lambda r: r["in_flight"])
            if busiest["in_flight"] >= 4:
                break
            assert time.monotonic() < deadline, state
            await asyncio.sleep(0.02)
        victim = [name_of(u) for u in fleet.urls].index(busiest["name"])
        await asyncio.to_thread(fleet.kill, victim)
        return await asyncio.gather(*tasks), busiest["name"]

    outcomes, victim_name = asyncio.run(scenario())
    failed = [i for i, err in enumerate(outcomes) if err is not None]
    assert all(started[i] for i in failed), [outcomes[i] for i in failed]  # only streams already under way broke
    assert all("failed mid-stream" in str(outcomes[i]) for i in failed)
    metrics = httpx.get(f"{router}/metrics", headers={"Authorization": f"Bearer {fleet.admin_token}"}).text
    series = f'loraplane_router_retries_total{{replica="{victim_name}"}}'
    retried = [line for line in metrics.splitlines() if line.startswith(series)]
    assert retried and float(retried[0].split()[-1]) >= 1, metrics  # queued work moved to the survivors
    assert table(fleet, router)[victim_name]["up"] is False

    victim = [name_of(u) for u in fleet.urls].index(victim_name)
    fleet.start(victim)
    fleet.ready(victim, timeout=180)
    deadline = time.monotonic() + 30
    while not table(fleet, router)[victim_name]["up"]:  # the health check brings it back
        assert time.monotonic() < deadline
        time.sleep(0.2)
