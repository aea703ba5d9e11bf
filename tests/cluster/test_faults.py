"""Faults only a cluster can show, on the story e2e/test_cluster.py leaves running (its BaseModel
and LoraAdapters in loraplane-demo): a serving pod deleted in the middle of a stream, and the
operator's pod deleted in the middle of a reconcile. Each is what a node drain, an eviction or a
`kubectl delete` does to a user's stack."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import httpx
import openai
import pytest
import yaml
from kubectl import (
    NODE_CACHE_PATH,
    RELEASE,
    RELEASE_NS,
    SKIP_REASON,
    agent_pod,
    enabled,
    get,
    kubectl,
    port_forward,
    rolled_out,
    running_pods,  # fmt: skip
)
from prometheus_client.parser import text_string_to_metric_families
from scenario import SteadyTraffic
from waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not enabled(), reason=SKIP_REASON)]
REPLICA_HEADER = "x-loraplane-replica"


def client(router: str, story: dict[str, Any]) -> openai.OpenAI:
    """The official client through the router, without retries: a failure counts as one."""
    return openai.OpenAI(base_url=f"{router}/v1", api_key=story["key"], max_retries=0, timeout=120)


def stream_until_deleted(
    router: str, story: dict[str, Any], delete: list[str], max_tokens: int
) -> tuple[str, list[dict[str, Any]], str | None]:
    """A long streamed completion; once its first chunk arrives, the pod serving it (the router's
    reply header names it) is deleted with ``kubectl delete pod <name> *delete``. Returns the pod,
    the chunks and how the stream ended: None when it ended with [DONE], else the error."""
    chunks: list[dict[str, Any]] = []
    body = {"model": story["adapter"], "prompt": "Write a long story about a lighthouse.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    headers = {"authorization": f"Bearer {story['key']}"}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        pod = r.headers[REPLICA_HEADER]
        ended: str | None = "the stream closed without [DONE]"
        try:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    ended = None
                    break
                event = json.loads(data)
                if "error" in event:
                    ended = f"error event: {event['error']}"
                    break
                chunks.append(event)
                if len(chunks) == 1:
                    kubectl("delete", "pod", "-n", story["ns"], pod, "--wait=false", *delete)
        except httpx.HTTPError as err:
            ended = f"{type(err).__name__}: {err}"
    return pod, chunks, ended


def at_full_strength(story: dict[str, Any]) -> int:
    """The BaseModel's replica count, once that many serving pods are Ready (an earlier test's
    replacement may still be loading the base)."""
    replicas: int = get("basemodel", story["ns"], story["base"])["spec"]["replicas"]
    wait_for(f"{replicas} serving pods Ready", lambda: len(running_pods(story["ns"], story["serving"])) == replicas, 600)
    return replicas


def replaced(story: dict[str, Any], gone: str, replicas: int) -> bool:
    names = [p["metadata"]["name"] for p in running_pods(story["ns"], story["serving"])]
    return gone not in names and len(names) == replicas


def test_a_serving_pod_deleted_mid_stream_drains_its_stream_and_is_replaced(story: dict[str, Any]) -> None:
    """`kubectl delete pod` (a drain, a rollout): the pod finishes the stream it holds, the router
    sends everything else to the other replica, and the Deployment brings the count back."""
    replicas = at_full_strength(story)
    with port_forward(story["ns"], f"svc/{story['base']}-router", 8000) as router:
        with SteadyTraffic(client(router, story), story["adapter"]) as load:
            # Short enough to finish inside the pod's 60 s grace period on a busy 2-core node.
            pod, chunks, ended = stream_until_deleted(router, story, [], max_tokens=48)
            assert ended is None, ended
            finished = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            assert finished[-1] == "length"  # all 48 tokens, then [DONE]
            wait_for(f"{pod} replaced", lambda: replaced(story, pod, replicas), 600)
            time.sleep(5)
        assert load.sent > 0 and load.failures == []


def test_a_serving_pod_killed_mid_stream_ends_it_with_an_error_and_nothing_else(story: dict[str, Any]) -> None:
    """`kubectl delete pod --force --grace-period=0` (a node lost): the stream it held cannot
    finish, so it ends with an error event rather than a silent cut; no other request fails."""
    replicas = at_full_strength(story)
    with port_forward(story["ns"], f"svc/{story['base']}-router", 8000) as router:
        with SteadyTraffic(client(router, story), story["adapter"]) as load:
            pod, _, ended = stream_until_deleted(router, story, ["--force", "--grace-period=0"], max_tokens=400)
            assert ended is not None and ended.startswith("error event"), ended
            wait_for(f"{pod} replaced", lambda: replaced(story, pod, replicas), 600)
            time.sleep(5)
        assert load.sent > 0 and load.failures == []


def test_the_operator_deleted_mid_reconcile_resumes_and_leaves_no_adapter_stuck(story: dict[str, Any]) -> None:
    """A new adapter applied, and the operator's pod deleted while it handles it: the Deployment's
    next pod picks the work up and the adapter reaches Ready."""
    fresh = adapter_like(story, "after-restart")
    operator = running_pods(RELEASE_NS, "app.kubernetes.io/component=operator")
    assert len(operator) == 1
    assert apply(fresh).returncode == 0
    kubectl("delete", "pod", "-n", RELEASE_NS, operator[0]["metadata"]["name"], "--wait=false")
    try:
        wait_for("after-restart Ready", lambda: (get("loraadapter", story["ns"], "after-restart").get("status") or {})
                 .get("phase") == "Ready", 600)  # fmt: skip
        new = running_pods(RELEASE_NS, "app.kubernetes.io/component=operator")
        assert [p["metadata"]["name"] for p in new] != [operator[0]["metadata"]["name"]]
    finally:
        kubectl("delete", "loraadapter", "-n", story["ns"], "after-restart", "--wait=false", check=False)


WEBHOOKS = "loraplane.dev.admission"


def apply(manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump(manifest), text=True, capture_output=True)


def webhook_configuration() -> dict[str, Any] | None:
    """kopf's ValidatingWebhookConfiguration once it lists webhooks (a stopping operator empties it)."""
    out = kubectl("get", "validatingwebhookconfiguration", WEBHOOKS, "-o", "json", check=False)
    config = json.loads(out) if out else None
    return config if config and config.get("webhooks") else None


def adapter_like(story: dict[str, Any], name: str, **spec: Any) -> dict[str, Any]:
    source = get("loraadapter", story["ns"], story["adapter"])
    return {"apiVersion": source["apiVersion"], "kind": "LoraAdapter", "metadata": {"name": name, "namespace": story["ns"]},
            "spec": {k: v for k, v in source["spec"].items() if k != "version"} | spec}  # fmt: skip


def test_the_webhook_refuses_bad_writes_and_blocks_none_while_the_operator_is_gone(story: dict[str, Any]) -> None:
    """The admission webhook as the API server calls it, through its Service: an adapter whose
    BaseModel does not exist is refused at `kubectl apply`. Then the operator is gone with its
    webhook configuration left behind, as a crash or a lost node leaves it (a graceful stop empties
    the configuration, so it is put back as it was): writes go straight through, the one the webhook
    would refuse too, and the reconcile judges them once the operator is back."""
    config = wait_for("the webhook configuration", webhook_configuration, 120)
    assert all(h["clientConfig"]["service"]["namespace"] == RELEASE_NS for h in config["webhooks"])
    orphan = adapter_like(story, "orphan", baseModel="nowhere")
    refused = apply(orphan)
    assert refused.returncode != 0, refused.stdout
    assert f'admission webhook "loraadapters.{WEBHOOKS}" denied' in refused.stderr, refused.stderr
    assert "spec.baseModel: BaseModel 'nowhere' does not exist" in refused.stderr

    deployment = f"deploy/{RELEASE}-operator"
    kubectl("scale", "-n", RELEASE_NS, deployment, "--replicas", "0")
    try:
        kubectl("wait", "-n", RELEASE_NS, "--for=delete", "pod", "-l", "app.kubernetes.io/component=operator", "--timeout=120s")
        left = {k: v for k, v in config["metadata"].items() if k in ("name", "labels", "annotations")}
        assert apply(config | {"metadata": left}).returncode == 0
        assert webhook_configuration() is not None
        for manifest in (orphan, adapter_like(story, "while-away")):
            start = time.monotonic()
            r = apply(manifest)
            assert r.returncode == 0, r.stderr
            assert time.monotonic() - start < 10  # not the webhook's 30 s timeout: the Service has no endpoints
    finally:
        kubectl("scale", "-n", RELEASE_NS, deployment, "--replicas", "1")
    try:
        wait_for("while-away Ready", lambda: get("loraadapter", story["ns"], "while-away").get("status", {})
                 .get("phase") == "Ready", 600)  # fmt: skip
        wait_for("orphan refused by the reconcile", lambda: any(c["reason"] == "BaseModelNotFound" for c in
                 get("loraadapter", story["ns"], "orphan").get("status", {}).get("conditions", [])), 120)  # fmt: skip
        wait_for("the webhook back", webhook_configuration, 120)
        assert apply(adapter_like(story, "orphan-2", baseModel="nowhere")).returncode != 0
    finally:
        kubectl("delete", "loraadapter", "-n", story["ns"], "orphan", "orphan-2", "while-away", "--wait=false", check=False)


def agent_figures(ns: str, pod: str) -> dict[str, float]:
    """The node agent's own series (``loraplane_node_cache_*``), read from its metrics port."""
    with port_forward(ns, f"pod/{pod}", 9090) as url:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("loraplane_node_cache_")}  # fmt: skip


# The files of the node's cache as the agent's container sees them (operator/children/node_cache.py
# mounts the node's folder there), each with its inode: a fetch writes new files, a read keeps them.
CACHE_INODES = """
import json, os
root = "/var/lib/loraplane-node/adapters"
print(json.dumps({os.path.relpath(os.path.join(d, f), root): os.stat(os.path.join(d, f)).st_ino
                  for d, _, files in os.walk(root) for f in files}))
"""


def cache_files(ns: str, pod: str) -> dict[str, int]:
    found: dict[str, int] = json.loads(kubectl("exec", "-n", ns, pod, "--", "python3", "-c", CACHE_INODES))
    return found


def test_the_node_agent_restarted_keeps_the_node_cache_and_the_traffic(story: dict[str, Any]) -> None:
    """The BaseModel's node cache turned on (its agent a DaemonSet, the serving pods reading adapters
    through it), then the agent's pod deleted while the traffic flows: the DaemonSet's next pod adopts
    the node's cache as it was, fetching nothing again and evicting nothing, and no request fails."""
    resources = get("basemodel", story["ns"], story["base"])["spec"]["resources"]
    # Agents run on the nodes that serve the base: here, every Linux node. A smaller CPU request
    # lets the rollout's surge pod fit the 2-core node beside the old replicas.
    patch = {"spec": {"nodeCache": {"enabled": True, "hostPath": NODE_CACHE_PATH},
                      "resources": {"nodeSelector": {"kubernetes.io/os": "linux"}, "cpu": "200m"}}}  # fmt: skip
    kubectl("patch", "basemodel", "-n", story["ns"], story["base"], "--type=merge", "-p", json.dumps(patch))
    try:
        first = wait_for("the node agent Ready", lambda: agent_pod(story), 300)

        def all_staged(pod: str) -> dict[str, float] | None:
            node = (get("basemodel", story["ns"], story["base"]).get("status", {}).get("nodeCache") or {}).get("perNode")
            figures = agent_figures(story["ns"], pod)
            done = node and node[0]["staged"] > 0 and node[0]["stagedMissing"] == 0
            return figures if done and figures["loraplane_node_cache_staged_bytes"] > 0 else None

        before = wait_for("the staged adapters on the node", lambda: all_staged(first), 600, every=5)
        files = cache_files(story["ns"], first)
        assert any(name.endswith(".safetensors") for name in files), files
        rolled_out(story, cached=True)
        for pod in running_pods(story["ns"], story["serving"]):  # every replica reads through the agent
            assert any(v["name"] == "node-cache" for v in pod["spec"]["volumes"]), pod["metadata"]["name"]
        with port_forward(story["ns"], f"svc/{story['base']}-router", 8000) as router:
            with SteadyTraffic(client(router, story), story["adapter"]) as load:
                kubectl("delete", "pod", "-n", story["ns"], first)
                second = wait_for("the agent's next pod Ready", lambda: agent_pod(story, other_than=first), 300)
                after = wait_for("the next agent sees the staged set", lambda: all_staged(second), 300, every=5)
                time.sleep(5)
            assert load.sent > 0 and load.failures == []
        assert cache_files(story["ns"], second) == files  # the very files: none fetched again, none evicted
        assert after["loraplane_node_cache_entries"] == before["loraplane_node_cache_entries"]
        assert after["loraplane_node_cache_bytes"] == before["loraplane_node_cache_bytes"]
        assert after.get("loraplane_node_cache_fetch_seconds_count", 0) == 0  # the next agent's own count
    finally:
        undo = {"nodeCache": {"enabled": False}, "resources": {"nodeSelector": None, "cpu": resources["cpu"]}}
        kubectl("patch", "basemodel", "-n", story["ns"], story["base"], "--type=merge", "-p", json.dumps({"spec": undo}))
        rolled_out(story, cached=False)
        pods = lambda: get("pods", story["ns"], selector=story["serving"])["items"]  # noqa: E731
        wait_for("the node-cache pods gone", lambda: not any(p["metadata"].get("deletionTimestamp") for p in pods()), 300)
        at_full_strength(story)
