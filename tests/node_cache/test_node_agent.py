"""The node agent as a real process on loopback against an S3 server (moto behind a proxy that
counts what is read from it), with serving engines that read their adapters and base from it."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_helpers import engine_greedy, tiny_engine
from flaky_proxy import flaky_proxy
from node_agent_process import TOKEN, call, node_agent, serving_process
from s3_server import moto_server, upload_folder
from small_disk import fill, small_disk
from waiting import wait_for

from loraplane.adapter_format import adapter_digest
from loraplane.node_cache.base_copy import folder_digest, published_path
from loraplane.serving.api.admin.view import replica_stats
from loraplane.serving.bench.deployment import child_command

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def store(tiny_llama: Path, tiny_adapters: dict[str, Path]):
    """(the proxy the agents read through, each adapter's URI) on one moto server."""
    with moto_server() as endpoint, flaky_proxy(endpoint) as proxy:
        uris = {name: upload_folder(endpoint, "adapters", f"acme/{name}", folder) for name, folder in tiny_adapters.items()}
        uris["base"] = upload_folder(endpoint, "models", "tiny-llama", tiny_llama)
        yield proxy, uris


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, list[int]]:
    engine = tiny_engine(tiny_llama, tmp_path_factory.mktemp("ref"), tiny_adapters)
    return {name: engine_greedy(engine, [(PROMPT, name)], 6)[0][0] for name in tiny_adapters}


def pod(base: Path, node_cache: Path, url: str, scratch: Path, monkeypatch: pytest.MonkeyPatch, name: str | None = None):  # type: ignore[no-untyped-def]
    """A serving process on the node: its own scratch cache, the node cache read through the agent.
    ``name``: the base's model id (the adapters name the folder they were trained on)."""
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", TOKEN)
    return tiny_engine(base, scratch, max_loras=2, node_cache_url=url, node_cache_dir=node_cache, base_name=name)


def answer(engine, name: str) -> list[int]:  # type: ignore[no-untyped-def]
    from loraplane.serving.engine.sampling_params import SamplingParams
    from loraplane.serving.engine.sequence import FinishReason

    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), [name])
    assert out.finish_reason is not FinishReason.ERROR, out.error
    return list(out.token_ids)


def fetched_from(engine, name: str) -> str:  # type: ignore[no-untyped-def]
    """Where the adapter's files came from: disk (the node cache had them) or cold (fetched)."""
    (tier,) = set(replica_stats(engine).adapters[name].load_seconds) & {"disk", "cold"}
    return tier


def state(url: str) -> dict:  # type: ignore[type-arg]
    response = call(url, "GET", "/v1/state")
    assert response.status_code == 200, response.text
    return response.json()


def test_two_pods_on_a_node_share_one_fetch(store, tiny_llama, tiny_adapters, reference, tmp_path, monkeypatch) -> None:
    from loraplane.serving.lora.entries import AdapterSpec

    proxy, uris = store
    digest = adapter_digest(tiny_adapters["mlp16"])
    with node_agent(tmp_path / "node", proxy.url) as url:
        first = pod(tiny_llama, tmp_path / "node", url, tmp_path / "pod-a", monkeypatch)
        first.register_lora(AdapterSpec("mlp16", uris["mlp16"], digest=digest))
        assert answer(first, "mlp16") == reference["mlp16"]
        assert fetched_from(first, "mlp16") == "cold"
        read = proxy.bytes_from_target
        second = pod(tiny_llama, tmp_path / "node", url, tmp_path / "pod-b", monkeypatch)
        second.register_lora(AdapterSpec("mlp16", uris["mlp16"], digest=digest))
        assert answer(second, "mlp16") == reference["mlp16"]
        assert fetched_from(second, "mlp16") == "disk"
        assert proxy.bytes_from_target == read  # the second pod's load read nothing from the store
        # The pods wrote nothing of their own: the files are the agent's, on the node.
        assert not list((tmp_path / "pod-a").glob("adapters/*/adapter_model.safetensors"))
        figures = state(url)
        assert (figures["hits"], figures["misses"], figures["entries"]) == (1, 1, 1)
        assert replica_stats(second).disk_cache.entries == 1 or wait_for(
            "the pod's node cache figures", lambda: replica_stats(second).disk_cache.entries == 1, timeout=15
        )


def test_a_staged_adapter_serves_a_restarted_pod_without_reading_the_store(
    store, tiny_llama, tiny_adapters, reference, tmp_path, monkeypatch
) -> None:
    from loraplane.serving.lora.entries import AdapterSpec

    proxy, uris = store
    digest = adapter_digest(tiny_adapters["qv4"])
    with node_agent(tmp_path / "node", proxy.url) as url:
        staged = call(url, "PUT", "/v1/staging", {"adapters": [{"source": uris["qv4"], "digest": digest}]})
        assert staged.status_code == 204, staged.text
        wait_for("qv4 staged on the node", lambda: state(url)["staged"][0]["cached"], timeout=30)
        connections = proxy.connections
        # A pod (a restart, or a new one on the node) serves its first request without the store.
        engine = pod(tiny_llama, tmp_path / "node", url, tmp_path / "pod", monkeypatch)
        engine.register_lora(AdapterSpec("qv4", uris["qv4"], digest=digest))
        assert answer(engine, "qv4") == reference["qv4"]
        assert fetched_from(engine, "qv4") == "disk"
        assert proxy.connections == connections
    # The agent itself restarted: its cache is still the node's.
    with node_agent(tmp_path / "node", proxy.url) as url:
        restarted = pod(tiny_llama, tmp_path / "node", url, tmp_path / "pod-2", monkeypatch)
        restarted.register_lora(AdapterSpec("qv4", uris["qv4"], digest=digest))
        assert answer(restarted, "qv4") == reference["qv4"]
        assert proxy.connections == connections


def test_the_node_cache_stays_in_its_bound_keeping_what_is_pinned(store, tiny_adapters, tmp_path) -> None:
    proxy, uris = store
    names = ["mlp16", "qv4", "all8"]
    sizes = {n: (tiny_adapters[n] / "adapter_model.safetensors").stat().st_size for n in names}
    bound = sizes["mlp16"] + max(sizes["qv4"], sizes["all8"]) + 4096  # the pinned one and one more
    digests = {n: adapter_digest(tiny_adapters[n]) for n in names}
    with node_agent(tmp_path / "node", proxy.url, "--max-bytes", str(bound), "--policy", "lru") as url:
        # Staged more than fits: the head is held, the agent says the rest does not fit, and it
        # settles instead of refetching the tail on every pass.
        wanted = [{"source": uris[n], "digest": digests[n], "pinned": n == "mlp16"} for n in names]
        assert call(url, "PUT", "/v1/staging", {"adapters": wanted}).status_code == 204
        figures = wait_for(
            "staging to settle", lambda: (s := state(url))["staged_fit"] is False and s["staged"][1]["cached"] and s, timeout=30
        )
        assert figures["bytes"] <= bound and figures["staged"][0]["cached"] and not figures["staged"][2]["cached"]
        settled = proxy.connections
        call(url, "PUT", "/v1/staging", {"adapters": wanted})  # wakes the staging pass at once
        time.sleep(6)  # and one more on its own
        assert proxy.connections == settled
        # Pods' reads take turns in the room the pinned one leaves, least recently used out first.
        assert call(url, "PUT", "/v1/staging", {"adapters": wanted[:1]}).status_code == 204
        for name in ["all8", "qv4", "all8"]:
            got = call(url, "POST", "/v1/acquire", {"source": uris[name], "digest": digests[name]})
            assert got.status_code == 200, got.text
            assert call(url, "POST", "/v1/release", {"lease": got.json()["lease"]}).status_code == 204
            figures = state(url)
            held = {n for n in names if (tmp_path / "node" / "adapters" / adapter_digest(tiny_adapters[n])[7:]).is_dir()}
            assert held == {"mlp16", name} and figures["bytes"] <= bound, figures
        assert figures["evictions"] >= 3


def test_a_full_disk_is_an_error_retried_not_a_staged_set_too_large(store, tiny_adapters, tmp_path) -> None:
    """The volume full (a real one: a small tmpfs) under a cache with no bound of its own: the
    fetch's ENOSPC is the disk's, not the bound's. The adapter says so in its error and is retried;
    the staged set is not reported as larger than the cache (it has no bound), and once space is
    freed the retry lands it."""
    proxy, uris = store
    digest = adapter_digest(tiny_adapters["qv4"])
    with small_disk(tmp_path / "node", 2048) as disk, node_agent(disk, proxy.url) as url:
        filler = fill(disk)
        assert call(url, "PUT", "/v1/staging", {"adapters": [{"source": uris["qv4"], "digest": digest}]}).status_code == 204
        failed = wait_for("the fetch to fail", lambda: (s := state(url))["staged"][0]["error"] and s, timeout=30)
        assert "No space left" in failed["staged"][0]["error"] and failed["staged_fit"] is True, failed
        filler.unlink()
        wait_for("the retry to land it", lambda: state(url)["staged"][0]["cached"], timeout=60)


def test_an_agent_killed_mid_fetch_starts_clean_and_fetches_again(store, tiny_adapters, tmp_path) -> None:
    """SIGKILL while a fetch is landing (the store trickling): the half-written folder is not an
    entry, the restarted agent removes it at once (nobody else writes there), and the next acquire
    fetches the whole adapter."""
    proxy, uris = store
    request = {"source": uris["mlp16"], "digest": adapter_digest(tiny_adapters["mlp16"])}
    adapters = tmp_path / "node" / "adapters"
    started: list = []
    proxy.trickle = 2048  # ~20 KB/s: the 110 KB weights take seconds
    try:
        with node_agent(tmp_path / "node", proxy.url, started=started) as url:
            pending = threading.Thread(target=_quietly, args=(call, url, "POST", "/v1/acquire", request), daemon=True)
            pending.start()

            def landing() -> bool:
                return any(f.stat().st_size > 0 for d in adapters.glob(".fetch-*") for f in d.iterdir())

            wait_for("a fetch to be landing", landing, timeout=30)
            started[0].kill()
            started[0].wait()
    finally:
        proxy.trickle = None
    assert list(adapters.glob(".fetch-*")) and not [p for p in adapters.iterdir() if len(p.name) == 64]  # no entry
    with node_agent(tmp_path / "node", proxy.url) as url:
        assert not list(adapters.glob(".fetch-*"))
        got = call(url, "POST", "/v1/acquire", request)
        assert got.status_code == 200, got.text
        assert adapter_digest(adapters / got.json()["content"]) == request["digest"]


def _quietly(fn, *args) -> None:  # type: ignore[no-untyped-def]
    with contextlib.suppress(Exception):
        fn(*args)


def test_a_corrupted_node_cache_file_is_fetched_again(store, tiny_adapters, tmp_path) -> None:
    proxy, uris = store
    request = {"source": uris["mlp16"], "digest": adapter_digest(tiny_adapters["mlp16"])}
    with node_agent(tmp_path / "node", proxy.url) as url:
        first = call(url, "POST", "/v1/acquire", request).json()
        call(url, "POST", "/v1/release", {"lease": first["lease"]})
        weights = tmp_path / "node" / "adapters" / first["content"] / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        again = call(url, "POST", "/v1/acquire", request).json()
        assert again["tier"] == "cold" and again["content"] == first["content"]
        assert (tmp_path / "node" / "adapters" / again["content"] / "adapter_model.safetensors").read_bytes() == (
            tiny_adapters["mlp16"] / "adapter_model.safetensors"
        ).read_bytes()


def test_refused_files_fail_their_own_call_with_the_reason(store, tmp_path) -> None:
    proxy, _ = store
    with node_agent(tmp_path / "node", proxy.url) as url:
        missing = call(url, "POST", "/v1/acquire", {"source": "s3://adapters/acme/nothing-here"})
        assert missing.status_code == 422 and missing.json()["detail"]["code"] == "MissingFile"
        assert call(url, "GET", "/v1/state").status_code == 200  # the agent serves on


def test_every_call_but_health_and_metrics_needs_the_token(store, tmp_path) -> None:
    import httpx

    proxy, uris = store
    with node_agent(tmp_path / "node", proxy.url) as url:
        for method, path, body in [("GET", "/v1/state", None), ("POST", "/v1/acquire", {"source": uris["qv4"]}),
                                   ("PUT", "/v1/staging", {"adapters": []}), ("PUT", "/v1/pins", {"client": "x"})]:  # fmt: skip
            refused = httpx.request(method, url + path, json=body, headers={"Authorization": "Bearer wrong"})
            assert refused.status_code == 401, path
        assert httpx.get(url + "/health").status_code == 200
        metrics = httpx.get(url + "/metrics/").text
        assert 'loraplane_node_cache_bytes{node="node-1"}' in metrics


def wait_base(cache: Path, source: str, timeout: float) -> subprocess.CompletedProcess[str]:
    command = child_command("node-agent", "--cache-dir", str(cache), "wait-base", "--source", source, "--timeout", str(timeout))
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_a_base_whose_digest_differs_is_never_published(store, tmp_path) -> None:
    proxy, uris = store
    wrong = "sha256:" + "1" * 64
    with node_agent(tmp_path / "node", proxy.url, "--base-source", uris["base"], "--base-digest", wrong) as url:
        base = wait_for("the base copy to fail", lambda: (b := state(url)["base"])["error"] and b)
        assert "BaseDigestMismatch" in base["error"] and not base["ready"]
        assert not published_path(tmp_path / "node", uris["base"]).exists()
        assert not [p for p in (tmp_path / "node" / "bases").iterdir() if p.name != "by-source"]  # nothing half-kept
        waited = wait_base(tmp_path / "node", uris["base"], timeout=1)
        assert waited.returncode != 0 and "not published" in waited.stderr


def test_the_base_is_copied_once_per_node_and_serves_two_serving_processes(store, tiny_llama, tiny_adapters, tmp_path) -> None:
    """Two ``loraplane serve`` processes on one node, and a restart of one: the base is read from the
    store once, by the agent; a staged adapter serves each process's first request; the restarted
    process serves it with no contact with the store at all."""
    proxy, uris = store
    base_digest, digest = folder_digest(tiny_llama), adapter_digest(tiny_adapters["qv4"])
    node = tmp_path / "node"
    with node_agent(node, proxy.url, "--base-source", uris["base"], "--base-digest", base_digest) as url:
        wait_for("the base on the node", lambda: state(url)["base"]["ready"], timeout=60)
        call(url, "PUT", "/v1/staging", {"adapters": [{"source": uris["qv4"], "digest": digest}]})
        wait_for("qv4 staged", lambda: state(url)["staged"][0]["cached"], timeout=30)
        waited = wait_base(node, uris["base"], timeout=10)
        assert waited.returncode == 0, waited.stderr
        path = Path(waited.stdout.strip())
        assert folder_digest(path.resolve()) == base_digest
        connections = proxy.connections

        from loraplane.serving.engine.sampling_params import SamplingParams

        local = tiny_engine(tiny_llama, tmp_path / "local", {"qv4": tiny_adapters["qv4"]})
        (expected,) = local.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), ["qv4"])

        def ask(server: str) -> str:
            load = {"lora_name": "qv4", "lora_path": uris["qv4"], "digest": digest}
            loaded = httpx.post(f"{server}/v1/load_lora_adapter", json=load, headers={"Authorization": f"Bearer {TOKEN}"})
            assert loaded.status_code == 200, loaded.text
            body = {"model": "qv4", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            done = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
            assert done.status_code == 200, done.text
            return str(done.json()["choices"][0]["text"])

        for i in range(2):  # two serving processes on the node, one after the other restarted
            with serving_process(path, str(tiny_llama), node, url, tmp_path / f"pod-{i}") as server:
                assert ask(server) == expected.text
        with serving_process(path, str(tiny_llama), node, url, tmp_path / "pod-0") as restarted:
            assert ask(restarted) == expected.text
        assert proxy.connections == connections  # not the base, not the adapter: the node had both
    with node_agent(node, proxy.url, "--base-source", uris["base"], "--base-digest", base_digest) as url:
        wait_for("the base on the node", lambda: state(url)["base"]["ready"], timeout=60)
        assert proxy.connections == connections  # a restarted agent finds its copy


def test_a_copy_that_fails_half_way_publishes_nothing(tiny_llama, tmp_path, monkeypatch) -> None:
    """A crash or a store failure in the middle of a base's copy: nothing is published, nothing
    half-written is left, and the next try starts clean."""
    from loraplane.node_cache import base_copy

    def half(source: str, into: Path, *_: object) -> None:
        (into / "config.json").write_text((tiny_llama / "config.json").read_text())
        raise ConnectionError("the store went away")

    monkeypatch.setattr(base_copy, "_download", half)
    store = base_copy.BaseStore(tmp_path)
    with pytest.raises(ConnectionError):
        store.ensure(f"file://{tiny_llama}", None, None)
    assert store.published(f"file://{tiny_llama}") is None
    assert [p.name for p in (tmp_path / "bases").iterdir()] == ["by-source"]
    monkeypatch.undo()
    digest, folder = store.ensure(f"file://{tiny_llama}", folder_digest(tiny_llama), None)
    assert store.published(f"file://{tiny_llama}") == (digest, folder)


def test_staging_takes_the_operators_token_not_the_pods(store, tmp_path) -> None:
    import httpx

    proxy, _ = store
    with node_agent(tmp_path / "node", proxy.url, "--operator-token", "operator-only") as url:
        staged = {"adapters": [{"source": "s3://adapters/acme/x", "digest": "sha256:" + "0" * 64}]}
        assert call(url, "PUT", "/v1/staging", staged).status_code == 401  # the pods' (admin) token
        operator = {"Authorization": "Bearer operator-only"}
        assert httpx.put(url + "/v1/staging", json=staged, headers=operator).status_code == 204
        assert len(httpx.get(url + "/v1/state", headers=operator).json()["staged"]) == 1
        figures = call(url, "GET", "/v1/state")  # a pod reads the node's figures, not what is staged
        assert figures.status_code == 200 and figures.json()["staged"] == []
        assert httpx.get(url + "/v1/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert call(url, "PUT", "/v1/pins", {"client": "pod-a", "sources": []}).status_code == 204  # still the pods'


def test_a_source_outside_the_allowed_prefixes_is_refused(store, tiny_adapters, tmp_path) -> None:
    proxy, uris = store
    connections = proxy.connections
    with node_agent(tmp_path / "node", proxy.url, "--allowed-source", "s3://adapters/globex") as url:
        refused = call(url, "POST", "/v1/acquire", {"source": uris["qv4"]})  # s3://adapters/acme/qv4
        assert refused.status_code == 403 and refused.json()["detail"]["code"] == "source_not_allowed"
        assert proxy.connections == connections  # refused before anything was fetched
    with node_agent(tmp_path / "node", proxy.url, "--allowed-source", "s3://adapters/acme") as url:
        assert call(url, "POST", "/v1/acquire", {"source": uris["qv4"]}).status_code == 200


def test_a_lease_outlives_the_agents_restart(tiny_adapters, tmp_path) -> None:
    """A pod reading a folder under a lease while the agent restarts: the next agent holds that
    folder as the last one did, so fetches that need room evict something else, and the pod's
    release, sent to the next agent, lets it go. (Without the leases' file the restarted agent
    evicted the folder mid-read: it was the least recently used.)"""
    from loraplane.node_cache.agent import NodeAgent

    names = ["mlp16", "qv4", "all8"]
    sources = {n: str(tiny_adapters[n]) for n in names}
    digests = {n: adapter_digest(tiny_adapters[n]) for n in names}
    bound = sum(sorted((tiny_adapters[n] / "adapter_model.safetensors").stat().st_size for n in names)[1:]) + 4096
    node = tmp_path / "node"

    def held(name: str) -> bool:
        return (node / "adapters" / digests[name].removeprefix("sha256:")).is_dir()

    first = NodeAgent(node, "node-a", max_bytes=bound, policy="lru")
    reading = first.acquire(sources["mlp16"], digests["mlp16"])  # and the agent dies before the release
    del first
    agent = NodeAgent(node, "node-a", max_bytes=bound, policy="lru")
    agent.store.enforce()  # as the background pass does once the pins are known again
    for name in ["qv4", "all8", "qv4"]:  # each needs the room of the one before
        agent.release(agent.acquire(sources[name], digests[name]).lease)
        assert held("mlp16") and held(name), name
    assert agent.store.evictions == 2
    agent.release(reading.lease)
    agent.release(agent.acquire(sources["all8"], digests["all8"]).lease)
    assert not held("mlp16") and held("all8") and held("qv4")  # released: the least recent, so evicted


def test_a_leases_file_that_is_not_the_agents_holds_nothing_it_should_not(tiny_adapters, tmp_path) -> None:
    """The file lies on the node's disk: whatever it holds, the agent starts, holds no folder for a
    record that is malformed, names no entry or has run out, and cuts a far expiry to a lease's."""
    import json

    from loraplane.node_cache.agent import LEASES_FILE, NodeAgent

    node = tmp_path / "node"
    first = NodeAgent(node, "node-a", max_bytes=None)
    got = first.acquire(str(tiny_adapters["qv4"]), adapter_digest(tiny_adapters["qv4"]))
    first.release(got.lease)
    far, content = time.time() + 1e9, got.content
    ran_out = {"k": {"content": content, "until": time.time() - 1}}
    for saved in ["{not json", "[1, 2]", {"k": {"content": "../../etc", "until": far}}, {"k": {"content": 5}},
                  {"k": {"content": content, "until": "soon"}}, ran_out]:  # fmt: skip
        (node / LEASES_FILE).write_text(saved if isinstance(saved, str) else json.dumps(saved))
        assert NodeAgent(node, "node-a", max_bytes=None).store._reading == {}, saved
    (node / LEASES_FILE).write_text(json.dumps({"k": {"content": content, "until": far}}))
    agent = NodeAgent(node, "node-a", max_bytes=None, lease_seconds=300)
    assert agent.store._reading == {content: 1}
    assert agent._leases["k"][1] <= time.monotonic() + 300
