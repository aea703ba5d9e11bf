"""The end-to-end story, written once for two clusters: a test control plane on loopback (etcd and
kube-apiserver, in the test suite) and a real cluster with nodes (`make e2e-cluster`). A ``Cluster``
is whatever can apply a manifest the way `kubectl apply` does and read an object back; the rest is
the user's view: manifests in, status and answers out."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import openai
import yaml
from waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "embedded"


class Cluster(Protocol):
    def apply(self, obj: dict[str, Any]) -> Any: ...

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None: ...


def example_manifests() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The BaseModel and the LoraAdapters of examples/embedded, as a user would apply them."""
    base = yaml.safe_load((EXAMPLES / "basemodel.yaml").read_text())
    adapters = [d for d in yaml.safe_load_all((EXAMPLES / "loraadapters.yaml").read_text()) if d]
    return base, adapters


def status_of(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    obj = cluster.get("LoraAdapter", namespace, name) or {}
    return obj.get("status") or {}


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


@dataclass
class SteadyTraffic:
    """Requests to one adapter through the router, one after another, until stopped: what a
    promotion must not break."""

    client: openai.OpenAI
    model: str
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.client.completions.create(model=self.model, prompt="steady traffic", max_tokens=4)
            except openai.APIError as err:
                self.failures.append(repr(err))
            self.sent += 1

    def __enter__(self) -> SteadyTraffic:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=120)


def promote(cluster: Cluster, manifest: dict[str, Any], uri: str, digest: str) -> dict[str, Any]:
    """Commit a new version to the manifest (what the fine-tuning pipeline does in git) and apply it."""
    changed = {**manifest, "spec": {**manifest["spec"], "source": {"uri": uri, "digest": digest}}}
    cluster.apply(changed)
    return changed


def daily_promotion(
    cluster: Cluster, manifest: dict[str, Any], client: openai.OpenAI, versions: dict[str, tuple[str, str]],
    timeout: float = 120,
) -> tuple[SteadyTraffic, dict[str, Any]]:  # fmt: skip
    """``versions``: "v1" (serving now), "v2" (good), "broken" (bad digest) as (uri, digest).
    Under steady traffic: v2 is promoted, the broken one refused while v2 keeps serving, and
    reverting the manifest to v1 rolls back. Returns the traffic record and the refusal's condition."""
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    served = manifest["spec"].get("servedName", name)

    def serving(digest: str) -> Callable[[], bool]:
        return lambda: (
            status_of(cluster, ns, name).get("servingDigest") == digest
            and not status_of(cluster, ns, name).get("promotingDigest")
        )

    with SteadyTraffic(client, served) as traffic:
        wait_for("traffic to flow", lambda: traffic.sent >= 3, timeout)
        promote(cluster, manifest, *versions["v2"])
        wait_for("v2 to serve", serving(versions["v2"][1]), timeout)
        assert (condition(status_of(cluster, ns, name), "Promoted") or {}).get("status") == "True"
        before = traffic.sent
        wait_for("requests on v2", lambda: traffic.sent >= before + 3, timeout)

        promote(cluster, manifest, *versions["broken"])

        def refused() -> dict[str, Any] | None:
            c = condition(status_of(cluster, ns, name), "Promoted")
            return c if c and c["status"] == "False" else None

        refusal = wait_for("the broken version to be refused", refused, timeout)
        assert status_of(cluster, ns, name)["servingDigest"] == versions["v2"][1]  # v2 keeps serving
        before = traffic.sent
        wait_for("requests while the broken version is refused", lambda: traffic.sent >= before + 3, timeout)

        promote(cluster, manifest, *versions["v1"])  # git revert
        wait_for("the revert to roll back to v1", serving(versions["v1"][1]), timeout)
        before = traffic.sent
        wait_for("requests on v1 again", lambda: traffic.sent >= before + 3, timeout)
    return traffic, refusal
