"""kubectl and helm as a user runs them, through the KUBECONFIG the environment names (the cluster
tests' only way in: no client library, so they drive the cluster exactly as the docs do)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from waiting import wait_for

from loraplane.serving.http.loopback import free_port

REPO = Path(__file__).resolve().parents[2]
RELEASE_NS = os.environ.get("LORAPLANE_E2E_RELEASE_NAMESPACE", "loraplane")
RELEASE = os.environ.get("LORAPLANE_E2E_RELEASE", "loraplane")
CHART = REPO / "charts" / "loraplane"
LOCAL_VALUES = CHART / "ci" / "local-cluster-values.yaml"
# The node cache's folder on the node when a test turns it on (a hostPath: the one-node cluster's
# teardown removes it; on a user's cluster it stays on the node).
NODE_CACHE_PATH = "/var/lib/loraplane-cluster-test"


def kubectl(*args: str, check: bool = True, timeout: float = 300) -> str:
    r = subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {r.stderr or r.stdout}")
    return r.stdout


def get(kind: str, namespace: str | None, name: str | None = None, selector: str | None = None,
        all_namespaces: bool = False) -> Any:  # fmt: skip
    args = ["get", kind] + ([name] if name else []) + (["-n", namespace] if namespace else [])
    args += (["-l", selector] if selector else []) + (["-A"] if all_namespaces else [])
    return json.loads(kubectl(*args, "-o", "json"))


def helm(*args: str, timeout: float = 900) -> str:
    r = subprocess.run(["helm", *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {r.stderr or r.stdout}")
    return r.stdout


def running_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods of the selector that are Ready and not being deleted."""
    pods = get("pods", namespace, selector=selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]  # fmt: skip


def enabled() -> bool:
    """Whether a cluster is there to drive: `make cluster-test` (or a user) sets LORAPLANE_E2E_CLUSTER=1
    with a KUBECONFIG, and kubectl and helm are on PATH. The cluster tests are skipped otherwise."""
    import shutil

    return os.environ.get("LORAPLANE_E2E_CLUSTER") == "1" and bool(shutil.which("kubectl") and shutil.which("helm"))


SKIP_REASON = "a real-cluster test: make cluster-test (or LORAPLANE_E2E_CLUSTER=1 with a KUBECONFIG, kubectl and helm)"


@contextmanager
def port_forward(namespace: str, target: str, port: int) -> Iterator[str]:
    """`kubectl port-forward` to ``target`` on a free local port, once it answers."""
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


def agent_pod(story: dict[str, Any], other_than: str | None = None) -> str | None:
    pods = running_pods(story["ns"], f"loraplane.dev/base-model={story['base']},app.kubernetes.io/component=node-cache")
    names = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != other_than]
    return names[0] if names else None


def rolled_out(story: dict[str, Any], cached: bool) -> None:
    """The serving Deployment rolled out once the operator has written the BaseModel's change into
    it (``rollout status`` alone may see the rollout before the change, complete)."""
    deployment = f"{story['base']}-serving"

    def written() -> bool:
        volumes = get("deployment", story["ns"], deployment)["spec"]["template"]["spec"].get("volumes", [])
        return any(v["name"] == "node-cache" for v in volumes) == cached

    wait_for(f"{deployment} with the node cache {'on' if cached else 'off'}", written, 120, every=1)
    kubectl("rollout", "status", "-n", story["ns"], f"deploy/{deployment}", "--timeout=600s", timeout=660)
