"""``dedicated.mode: auto`` with real pods, on the story e2e/test_cluster.py leaves running. An
adapter of its own (a copy of the demo's first, same tenant) takes the traffic through the router
and dominates; the operator starts its merged deployment (a kubelet runs the pod, which fetches
the adapter, merges it into the embedded base and serves it under the adapter's name), gives up a
replica of the shared pool for it, and the router sends the adapter's requests there. A promotion
while it is dedicated rolls the merged pod onto the new version; when the traffic ends the adapter
returns to the shared pool, which is whole again; dominant once more, the adapter is deleted and
its merged deployment goes with it. No request fails at any switch."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import openai
import pytest
import yaml
from kubectl import SKIP_REASON, enabled, get, kubectl, port_forward, running_pods
from scenario import SteadyTraffic, condition
from waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not enabled(), reason=SKIP_REASON)]
POLICY = {"mode": "auto", "share": 0.5, "holdSeconds": 10, "returnShare": 0.2, "returnSeconds": 20,
          "minRequestsPerSecond": 0.2, "maxReplicas": 1}  # fmt: skip
NAME = "solo"
SELECTOR = f"loraplane.dev/dedicated-adapter={NAME}"


def patch(kind: str, story: dict[str, Any], name: str, body: dict[str, Any]) -> None:
    kubectl("patch", kind, "-n", story["ns"], name, "--type=merge", "-p", json.dumps(body))


def status(story: dict[str, Any]) -> dict[str, Any]:
    return get("loraadapter", story["ns"], NAME).get("status") or {}


def dominant(story: dict[str, Any]) -> bool:
    return (condition(status(story), "DedicatedRecommended") or {}).get("status") == "True"


def served_by(router: str, story: dict[str, Any]) -> str:
    """The pod the router sent one request to (its reply header)."""
    body = {"model": NAME, "prompt": "which pod?", "max_tokens": 2}
    r = httpx.post(f"{router}/v1/completions", json=body, headers={"authorization": f"Bearer {story['key']}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-loraplane-replica"]


def dedicated_pods(story: dict[str, Any]) -> list[str]:
    return [p["metadata"]["name"] for p in running_pods(story["ns"], SELECTOR)]


def leftovers(story: dict[str, Any], kind: str) -> list[Any]:
    """The adapter's dedicated objects of one kind still in the cluster."""
    items: list[Any] = get(kind, story["ns"], selector=SELECTOR)["items"]
    return items


def merged_digest(story: dict[str, Any]) -> str | None:
    found = leftovers(story, "configmaps")
    return yaml.safe_load(found[0]["data"]["engine.yaml"]).get("merged_lora_digest") if found else None


def pool(story: dict[str, Any]) -> int:
    return int(get("deployment", story["ns"], f"{story['base']}-serving")["spec"]["replicas"])


def test_a_dominant_adapter_moves_to_its_merged_deployment_and_back_without_a_failed_request(story: dict[str, Any]) -> None:
    ns = story["ns"]
    base = get("basemodel", ns, story["base"])
    replicas, policy = base["spec"]["replicas"], base["spec"].get("dedicated") or {"mode": "off"}
    source = get("loraadapter", ns, story["adapter"])
    original = source["status"]["servingUri"], source["status"]["servingDigest"]
    # Another adapter's version of the same base stands for the adapter's next fine-tune.
    other = get("loraadapter", ns, "shouty")["status"]
    newer = {"uri": other["servingUri"], "digest": other["servingDigest"]}
    manifest = {"apiVersion": source["apiVersion"], "kind": "LoraAdapter", "metadata": {"name": NAME, "namespace": ns},
                "spec": {"baseModel": story["base"], "tenant": source["spec"]["tenant"],
                         "source": {"uri": original[0], "digest": original[1]}}}  # fmt: skip
    subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump(manifest), text=True, check=True, capture_output=True)
    wait_for(f"{NAME} Ready", lambda: status(story).get("phase") == "Ready", 300)
    patch("basemodel", story, story["base"], {"spec": {"dedicated": POLICY}})
    try:
        with port_forward(ns, f"svc/{story['base']}-router", 8000) as router:
            client = openai.OpenAI(base_url=f"{router}/v1", api_key=story["key"], max_retries=0, timeout=120)
            with SteadyTraffic(client, NAME) as load:
                wait_for("it to dominate", lambda: dominant(story), 180)
                (first,) = wait_for("its merged pod Ready", lambda: dedicated_pods(story), 600, every=3)
                assert pool(story) == replicas - 1  # carved from the pool, not added to it
                wait_for("it to be served dedicated", lambda: status(story).get("servedFrom") == "dedicated", 60)
                wait_for("the router to send it there", lambda: served_by(router, story) == first, 60)
                assert merged_digest(story) == original[1]

                patch("loraadapter", story, NAME, {"spec": {"source": newer}})
                wait_for("the new version to serve", lambda: status(story).get("servingDigest") == newer["digest"]
                         and not status(story).get("promotingDigest"), 300)  # fmt: skip
                wait_for("the merged config to follow", lambda: merged_digest(story) == newer["digest"], 60)
                (second,) = wait_for("the merged pod rolled", lambda: [p for p in dedicated_pods(story) if p != first], 600,
                                     every=3)  # fmt: skip
                wait_for("the router to send it to the new pod", lambda: served_by(router, story) == second, 60)
            assert load.sent > 0 and load.failures == []

            wait_for("it to return", lambda: status(story).get("servedFrom") == "shared", 240)
            wait_for("its merged deployment gone", lambda: not leftovers(story, "deployments"), 120)
            assert pool(story) == replicas

            with SteadyTraffic(client, NAME) as load:
                wait_for("it to dominate again", lambda: dominant(story) and leftovers(story, "deployments"), 180)
                kubectl("delete", "loraadapter", "-n", ns, NAME, "--wait=false")
                # The garbage collector deletes what the adapter owned; the sync gives the replica back.
                wait_for("its merged deployment gone with it", lambda: not leftovers(story, "deployments"), 180)
                wait_for("the pool whole again", lambda: pool(story) == replicas, 60)
                load.stop.set()
            assert load.sent > 0
    finally:
        # The story's policy as it was (a merge patch's null takes out what it did not set).
        patch("basemodel", story, story["base"], {"spec": {"dedicated": {k: policy.get(k) for k in {*POLICY, *policy}}}})
        kubectl("delete", "loraadapter", "-n", ns, NAME, "--ignore-not-found", "--wait=false")
        wait_for("no merged pod left", lambda: not leftovers(story, "pods"), 300)
        wait_for(f"{replicas} serving pods Ready", lambda: len(running_pods(ns, story["serving"])) == replicas, 600)
