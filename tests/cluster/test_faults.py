"""Faults only a cluster can show, on the story e2e/test_cluster.py leaves running (its BaseModel
and LoraAdapters in loraplane-demo): a serving pod deleted in the middle of a stream, and the
operator's pod deleted in the middle of a reconcile. Each is what a node drain, an eviction or a
`kubectl delete` does to a user's stack."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import yaml
from kubectl import RELEASE_NS, SKIP_REASON, enabled, get, kubectl, running_pods
from scenario import example_manifests
from waiting import wait_for

from loraplane.serving.http.loopback import free_port

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


@contextmanager
def port_forward(namespace: str, target: str, port: int) -> Iterator[str]:
    local = free_port()
    proc = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, target, f"{local}:{port}"], stdout=subprocess.PIPE)
    try:
        wait_for(f"port-forward {target}", lambda: _listening(local) or proc.poll() is not None, 30)
        assert proc.poll() is None, f"kubectl port-forward {target} exited"
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()
        proc.wait()


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
    except httpx.HTTPError as err:
        return not isinstance(err, httpx.ConnectError)
    return True


class Load:
    """Short completions through the router, one after another, counting failures: what must not
    notice a replica going away."""

    def __init__(self, url: str, key: str, model: str) -> None:
        self.url, self.key, self.model = url, key, model
        self.sent, self.failures = 0, list[str]()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.key}"}, timeout=120) as http:
            while not self.stop.is_set():
                r = http.post("/v1/completions", json={"model": self.model, "prompt": "load", "max_tokens": 2})
                self.sent += 1
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=180)


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
        with Load(router, story["key"], story["adapter"]) as load:
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
        with Load(router, story["key"], story["adapter"]) as load:
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
