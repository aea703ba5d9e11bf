"""Faults only a cluster can show, on the story e2e/test_cluster.py leaves running (its BaseModel
and LoraAdapters in loraplane-demo): a serving pod deleted in the middle of a stream, and the
operator's pod deleted in the middle of a reconcile. Each is what a node drain, an eviction or a
`kubectl delete` does to a user's stack."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from typing import Any

import httpx
import openai
import pytest
import yaml
from kubectl import RELEASE_NS, SKIP_REASON, enabled, get, kubectl, port_forward, running_pods
from scenario import SteadyTraffic, example_manifests
from waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not enabled(), reason=SKIP_REASON)]
REPLICA_HEADER = "x-loraplane-replica"


@pytest.fixture(scope="module")
def story() -> dict[str, Any]:
    """The demo's namespace, BaseModel, first adapter and its tenant's API key, as test_cluster left them."""
    base, adapters = example_manifests()
    ns, name = base["metadata"]["namespace"], base["metadata"]["name"]
    secret = get("secret", ns, base["spec"]["tenancy"]["apiKeysSecret"]["name"])
    tenants = yaml.safe_load(base64.b64decode(secret["data"]["tenants.yaml"]))["tenants"]
    adapter = adapters[0]
    key = next(t["api_keys"][0] for t in tenants if t["name"] == adapter["spec"]["tenant"])
    return {"ns": ns, "base": name, "adapter": adapter["metadata"]["name"], "key": key,
            "serving": f"loraplane.dev/base-model={name},app.kubernetes.io/component=serving"}  # fmt: skip


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
    source = get("loraadapter", story["ns"], story["adapter"])
    fresh = {
        "apiVersion": source["apiVersion"], "kind": "LoraAdapter",
        "metadata": {"name": "after-restart", "namespace": story["ns"]},
        "spec": {k: v for k, v in source["spec"].items() if k != "version"},
    }  # fmt: skip
    operator = running_pods(RELEASE_NS, "app.kubernetes.io/component=operator")
    assert len(operator) == 1
    subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump(fresh).encode(), check=True, capture_output=True)
    kubectl("delete", "pod", "-n", RELEASE_NS, operator[0]["metadata"]["name"], "--wait=false")
    try:
        wait_for("after-restart Ready", lambda: (get("loraadapter", story["ns"], "after-restart").get("status") or {})
                 .get("phase") == "Ready", 600)  # fmt: skip
        new = running_pods(RELEASE_NS, "app.kubernetes.io/component=operator")
        assert [p["metadata"]["name"] for p in new] != [operator[0]["metadata"]["name"]]
    finally:
        kubectl("delete", "loraadapter", "-n", story["ns"], "after-restart", "--wait=false", check=False)
