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
from kubectl import NODE_CACHE_PATH, SKIP_REASON, agent_pod, enabled, get, kubectl, port_forward, rolled_out, running_pods
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
    return [p["metadata"]["name"] for p in running_pods(story["ns"], f"{SELECTOR},app.kubernetes.io/component=serving")]


def leftovers(story: dict[str, Any], kind: str) -> list[Any]:
    """The adapter's dedicated objects of one kind still in the cluster."""
    items: list[Any] = get(kind, story["ns"], selector=SELECTOR)["items"]
    return items


def merged_digest(story: dict[str, Any]) -> str | None:
    found = leftovers(story, "configmaps")
    return yaml.safe_load(found[0]["data"]["engine.yaml"]).get("merged_lora_digest") if found else None


def pool(story: dict[str, Any]) -> int:
    return int(get("deployment", story["ns"], f"{story['base']}-serving")["spec"]["replicas"])


def solo(story: dict[str, Any]) -> tuple[str, str]:
    """The test's own adapter, a copy of the story's first (same tenant, same version), Ready;
    its (uri, digest)."""
    ns = story["ns"]
    source = get("loraadapter", ns, story["adapter"])
    original = source["status"]["servingUri"], source["status"]["servingDigest"]
    manifest = {"apiVersion": source["apiVersion"], "kind": "LoraAdapter", "metadata": {"name": NAME, "namespace": ns},
                "spec": {"baseModel": story["base"], "tenant": source["spec"]["tenant"],
                         "source": {"uri": original[0], "digest": original[1]}}}  # fmt: skip
    subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump(manifest), text=True, check=True, capture_output=True)
    wait_for(f"{NAME} Ready", lambda: status(story).get("phase") == "Ready", 300)
    return original


def test_a_dominant_adapter_moves_to_its_merged_deployment_and_back_without_a_failed_request(story: dict[str, Any]) -> None:
    ns = story["ns"]
    base = get("basemodel", ns, story["base"])
    replicas, policy = base["spec"]["replicas"], base["spec"].get("dedicated") or {"mode": "off"}
    # Another adapter's version of the same base stands for the adapter's next fine-tune.
    other = get("loraadapter", ns, "shouty")["status"]
    newer = {"uri": other["servingUri"], "digest": other["servingDigest"]}
    original = solo(story)
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


# The agent's view of a merged model's copy on the node: the published link's target, or nothing.
PUBLISHED = """
import os, sys
from pathlib import Path
from loraplane.node_cache.base_copy import published_path
link = published_path(Path("/var/lib/loraplane-node"), sys.argv[1])
print(os.path.realpath(link) if os.path.exists(link) else "")
"""


def node_copy(story: dict[str, Any], uri: str) -> str:
    pod = agent_pod(story)
    assert pod is not None
    return kubectl("exec", "-n", story["ns"], pod, "--", "python3", "-c", PUBLISHED, uri).strip()


def test_with_a_merged_store_the_merge_is_written_once_and_each_node_copies_it(story: dict[str, Any]) -> None:
    """``dedicated.mergedStore``: a Job (owned by the adapter) merges the dominant adapter's version
    into the base once and writes it to the object store; the node agent copies it as an s3:// base,
    the dedicated pod serves that copy, and the router sends it the adapter's requests, none failing.
    Deleted, the adapter takes its Job and deployment with it, and the copy leaves the node."""
    ns = story["ns"]
    base = get("basemodel", ns, story["base"])
    replicas, policy = base["spec"]["replicas"], base["spec"].get("dedicated") or {"mode": "off"}
    resources = base["spec"]["resources"]
    original = solo(story)
    # Agents run on the nodes that serve the base (here every Linux node); a smaller CPU request fits
    # the 2-core node the rollout's surge pod, the merge Job and the dedicated pod.
    patch("basemodel", story, story["base"], {"spec": {
        "nodeCache": {"enabled": True, "hostPath": NODE_CACHE_PATH},
        "resources": {"nodeSelector": {"kubernetes.io/os": "linux"}, "cpu": "200m"},
        "dedicated": {**POLICY, "mergedStore": "s3://adapters/merged"}}})  # fmt: skip
    try:
        rolled_out(story, cached=True)
        with port_forward(ns, f"svc/{story['base']}-router", 8000) as router:
            client = openai.OpenAI(base_url=f"{router}/v1", api_key=story["key"], max_retries=0, timeout=120)
            with SteadyTraffic(client, NAME) as load:
                wait_for("it to dominate", lambda: dominant(story), 180)
                merged = wait_for("its merge written", lambda: status(story).get("mergedModel"), 600, every=3)
                assert merged["adapterDigest"] == original[1] and merged["uri"].startswith("s3://adapters/merged/")
                (job,) = leftovers(story, "jobs")
                assert job["status"].get("succeeded") == 1  # once: one Job, one pod that ran to the end
                (pod,) = wait_for("its merged pod Ready", lambda: dedicated_pods(story), 600, every=3)
                assert pool(story) == replicas - 1
                config = yaml.safe_load(leftovers(story, "configmaps")[0]["data"]["engine.yaml"])
                assert "merged_lora" not in config and config["served_model_name"] == NAME
                copy = node_copy(story, merged["uri"])
                assert copy.endswith(merged["digest"].removeprefix("sha256:"))  # the node's verified copy
                wait_for("the router to send it there", lambda: served_by(router, story) == pod, 60)
                load.stop.set()
            assert load.sent > 0 and load.failures == []
        kubectl("delete", "loraadapter", "-n", ns, NAME, "--wait=false")
        wait_for("its merged deployment and Job gone with it",
                 lambda: not leftovers(story, "deployments") and not leftovers(story, "jobs"), 180)  # fmt: skip
        wait_for("the copy gone from the node", lambda: node_copy(story, merged["uri"]) == "", 120)
    finally:
        undo = {"nodeCache": {"enabled": False}, "resources": {"nodeSelector": None, "cpu": resources.get("cpu")},
                "dedicated": {k: policy.get(k) for k in {*POLICY, *policy, "mergedStore"}}}  # fmt: skip
        patch("basemodel", story, story["base"], {"spec": undo})
        kubectl("delete", "loraadapter", "-n", ns, NAME, "--ignore-not-found", "--wait=false")
        wait_for("no merged pod left", lambda: not leftovers(story, "pods"), 300)
        rolled_out(story, cached=False)
        wait_for(f"{replicas} serving pods Ready", lambda: len(running_pods(ns, story["serving"])) == replicas, 600)
