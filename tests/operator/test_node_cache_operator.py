"""The node cache with the operator deciding staging: the real operator process against a real API
server (envtest.py), a real node agent process and serving replicas on loopback, and an S3 server
(moto) the agent reads through a proxy that counts connections. Pod objects stand in for the
kubelet's: the agent's on node-a, the replicas' beside it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import tiny_engine
from envtest import control_plane
from flaky_proxy import flaky_proxy
from node_agent_process import node_agent
from operator_process import start_operator
from s3_server import ACCESS, SECRET, moto_server, upload_folder
from serving_pods import admin_secret, serving_pod

from loraplane.adapter_format import adapter_digest
from loraplane.operator.children.names import COMPONENT_LABEL, NODE_CACHE_TOKEN_KEY
from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app

NS = "team-n"
TOKEN = "node-agent-test-token"  # node_agent_process's: the BaseModel's admin token, which the agent takes too
OPERATOR_TOKEN = "node-cache-operator-token"  # staging and state
pytestmark = pytest.mark.slow


def agent_pod(name: str, url: str, node: str) -> dict[str, Any]:
    pod = serving_pod(name, NS, "tiny", url)
    pod["metadata"]["labels"][COMPONENT_LABEL] = "node-cache"
    pod["spec"]["containers"][0]["name"] = "node-cache"
    pod["spec"]["nodeName"] = node
    return pod


def lora(name: str, uri: str, digest: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "loraplane.dev/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": name, "namespace": NS},
        "spec": {"baseModel": "tiny", "tenant": "acme", "source": {"uri": uri, "digest": digest}, **spec},
    }  # fmt: skip


@pytest.fixture(scope="module")
def cluster(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("node-cache-operator")
    with ExitStack() as stack:
        endpoint = stack.enter_context(moto_server())
        proxy = stack.enter_context(flaky_proxy(endpoint))
        kube = stack.enter_context(control_plane(folder / "kube"))
        uris = {n: upload_folder(endpoint, "adapters", f"acme/{n}", p) for n, p in tiny_adapters.items()}
        creds = {
            k: base64.b64encode(v.encode()).decode()
            for k, v in {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET}.items()
        }
        kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "store", "namespace": NS}, "data": creds})
        kube.apply(admin_secret(NS, "tiny", TOKEN))
        # The operator's own token for the agents, brought before the BaseModel as the admin one is.
        token = {NODE_CACHE_TOKEN_KEY: base64.b64encode(OPERATOR_TOKEN.encode()).decode()}
        kube.apply(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tiny-node-cache", "namespace": NS}, "data": token}
        )
        kube.apply({
            "apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny", "namespace": NS},
            "spec": {
                "source": {"uri": str(tiny_llama)}, "replicas": 1,
                "engine": {"maxLoras": 3, "maxLoraRank": 16, "maxCpuLoras": 8},
                # The operator validates adapters from the store itself; only the agent reads through the proxy.
                "adapterStore": {"endpoint": endpoint, "region": "us-east-1", "credentialsSecret": {"name": "store"}},
                "autoPinning": {"enabled": False}, "nodeCache": {"enabled": True},
                "resources": {"gpus": 0, "nodeSelector": {"loraplane.dev/serving": "true"}},
            },
        })  # fmt: skip
        node = folder / "node-a"
        agent = stack.enter_context(node_agent(node, proxy.url, "--operator-token", OPERATOR_TOKEN))
        kube.apply(agent_pod("tiny-node-cache-a", agent, "node-a"))

        def replica(name: str) -> str:
            def make():  # type: ignore[no-untyped-def]
                return tiny_engine(tiny_llama, folder / name, max_loras=3, node_cache_url=agent, node_cache_dir=node)

            url = stack.enter_context(serve_app(create_app(make, admin_token=TOKEN)))
            kube.apply(serving_pod(name, NS, "tiny", url))
            return url

        import os

        os.environ["LORAPLANE_ADMIN_TOKEN"] = TOKEN  # the replicas' node agent token, as the pod's env gives it
        replicas = {"tiny-serving-0": replica("tiny-serving-0")}
        operator = start_operator(kube.kubeconfig, folder / "operator.log")
        try:
            yield {"kube": kube, "proxy": proxy, "uris": uris, "agent": agent, "replica": replica, "replicas": replicas,
                   "log": folder / "operator.log"}  # fmt: skip
        finally:
            operator.terminate()
            operator.wait(timeout=30)
            os.environ.pop("LORAPLANE_ADMIN_TOKEN", None)


def agent_state(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/state", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}).json()  # type: ignore[no-any-return]


def test_the_operator_stages_adapters_on_the_nodes_and_reports_them(cluster: dict[str, Any], tiny_adapters) -> None:
    kube, uris = cluster["kube"], cluster["uris"]
    for kind, name in (("DaemonSet", "tiny-node-cache"), ("Service", "tiny-node-cache"), ("NetworkPolicy", "tiny-node-cache")):
        kube.wait_for(f"{kind} {name}", lambda kind=kind, name=name: kube.get(kind, NS, name), timeout=30)
    digest = adapter_digest(tiny_adapters["mlp16"])
    kube.apply(lora("hot", uris["mlp16"], digest, pinned=True))

    def reported() -> dict[str, Any] | None:
        obj = kube.get("LoraAdapter", NS, "hot")
        return obj if obj and obj.get("status", {}).get("nodesCached") == 1 else None

    try:
        kube.wait_for("nodesCached on the adapter", reported, timeout=60)
    except AssertionError:
        raise AssertionError(f"{kube.get('LoraAdapter', NS, 'hot')}\n{cluster['log'].read_text()[-3000:]}") from None
    staged = agent_state(cluster["agent"])["staged"]
    assert [(s["source"], s["digest"], s["cached"]) for s in staged] == [(uris["mlp16"], digest, True)]

    def base_status() -> dict[str, Any] | None:
        base = kube.get("BaseModel", NS, "tiny")
        status = (base or {}).get("status", {})
        ready = next((c for c in status.get("conditions", []) if c["type"] == "NodeCachesReady"), None)
        return status if ready and ready["status"] == "True" and status.get("nodeCache", {}).get("nodes") == 1 else None

    status = kube.wait_for("the BaseModel's node cache status", base_status, timeout=30)
    (node,) = status["nodeCache"]["perNode"]
    assert node["node"] == "node-a" and node["staged"] == 1 and node["bytes"] > 0

    # A prefetch-marked adapter nobody has asked for yet is staged too, after the pinned one.
    kube.apply(lora("next", uris["qv4"], adapter_digest(tiny_adapters["qv4"])))
    kube.wait_for(
        "the prefetch-marked adapter staged on the node",
        lambda: any(s["source"] == uris["qv4"] and s["cached"] for s in agent_state(cluster["agent"])["staged"]),
        timeout=60,
    )


def test_a_new_pod_on_the_node_serves_a_staged_adapter_without_reading_the_store(cluster: dict[str, Any]) -> None:
    kube = cluster["kube"]
    kube.wait_for(
        "hot Ready", lambda: (kube.get("LoraAdapter", NS, "hot") or {}).get("status", {}).get("nodesCached"), timeout=60
    )
    connections = cluster["proxy"].connections
    url = cluster["replica"]("tiny-serving-1")  # a new pod on node-a; the operator registers and pins hot on it

    def loaded() -> bool:
        state = httpx.get(f"{url}/admin/adapters/hot", headers={"Authorization": f"Bearer {TOKEN}"})
        return state.status_code == 200 and state.json()["tier"] in ("host", "device")

    kube.wait_for("hot loaded on the new pod", loaded, timeout=60)
    reply = httpx.post(f"{url}/v1/completions", json={"model": "hot", "prompt": "hello", "max_tokens": 4}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert cluster["proxy"].connections == connections  # the node had it: no object-store read for this pod


def test_turning_the_node_cache_off_stops_the_agents_and_clears_the_status(cluster: dict[str, Any]) -> None:
    kube = cluster["kube"]
    kube.merge_patch("BaseModel", NS, "tiny", {"spec": {"nodeCache": {"enabled": False}}})

    def retired() -> dict[str, Any] | None:
        daemons = kube.get("DaemonSet", NS, "tiny-node-cache") or {}
        selector = daemons.get("spec", {}).get("template", {}).get("spec", {}).get("nodeSelector", {})
        return daemons if selector.get("loraplane.dev/retired") == "true" else None

    kube.wait_for("the agents' DaemonSet to select no node", retired, timeout=30)

    def cleared() -> bool:
        status = (kube.get("BaseModel", NS, "tiny") or {}).get("status", {})
        return "nodeCache" not in status and all(c["type"] != "NodeCachesReady" for c in status.get("conditions", []))

    kube.wait_for("the node cache's status to go", cleared, timeout=30)
    gone = lambda: "nodesCached" not in (kube.get("LoraAdapter", NS, "hot") or {}).get("status", {"nodesCached": 1})  # noqa: E731
    kube.wait_for("the adapters' nodesCached to go", gone, timeout=30)
    config = kube.get("ConfigMap", NS, "tiny-engine")
    assert config is not None and "node_cache_url" not in config["data"]["engine.yaml"]

    def unmounted() -> bool:  # removed from the Deployment, not merged around (its pods would wait for it)
        pod = (kube.get("Deployment", NS, "tiny-serving") or {}).get("spec", {}).get("template", {}).get("spec", {})
        mounts = [m["name"] for c in pod.get("containers", []) for m in c.get("volumeMounts", [])]
        return bool(pod) and "node-cache" not in [v["name"] for v in pod.get("volumes", [])] + mounts

    kube.wait_for("the serving pods' node-cache volume to go", unmounted, timeout=30)
    # And back on: the agents run again where the BaseModel's selector says.
    kube.merge_patch("BaseModel", NS, "tiny", {"spec": {"nodeCache": {"enabled": True}}})

    def running_again() -> bool:
        daemons = kube.get("DaemonSet", NS, "tiny-node-cache") or {}
        selector = daemons.get("spec", {}).get("template", {}).get("spec", {}).get("nodeSelector", {})
        return selector == {"loraplane.dev/serving": "true"}

    kube.wait_for("the agents' DaemonSet to select the serving nodes again", running_again, timeout=30)
