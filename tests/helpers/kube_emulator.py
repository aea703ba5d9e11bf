"""A Kubernetes API for the tests: kmock's emulator served from a background thread, and the calls a
test makes against it the way kubectl would (plain HTTP, JSON). kmock keeps objects, watches,
merge patches and finalizers, but validates nothing; tests validate manifests against the CRD
schemas themselves (see crd_schema.py)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import kmock
import yaml
from waiting import wait_for

VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
RESOURCES = {
    "v1/namespaces": ("Namespace", False, set()),
    "v1/pods": ("Pod", True, {"status"}),
    "v1/secrets": ("Secret", True, set()),
    "v1/events": ("Event", True, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/services": ("Service", True, {"status"}),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}),
    "discovery.k8s.io/v1/endpointslices": ("EndpointSlice", True, set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, set()),
    "kopf.dev/v1/clusterkopfpeerings": ("ClusterKopfPeering", False, set()),
    "loraplane.dev/v1alpha1/basemodels": ("BaseModel", True, {"status"}),
    "loraplane.dev/v1alpha1/loraadapters": ("LoraAdapter", True, {"status"}),
}
PLURALS = {kind: key.rsplit("/", 1)[1] for key, (kind, _, _) in RESOURCES.items()}


WRITES = ("POST", "PUT", "PATCH", "DELETE")


@attrs.define(kw_only=True)
class IndexedEmulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """kmock with the costs a real API server does not have taken out, so that a fleet of thousands
    of adapters measures the operator rather than the emulator.

    - kmock answers a request for one object by scanning every stored object of every kind (Events
      included); this looks it up by key.
    - kmock keeps every request it ever served and, to route each new one, scans that whole log:
      each call costs O(requests so far) and a fleet goes quadratic. This counts the writes (what
      the tests assert on) and keeps only the latest few requests.
    """

    write_count: int = attrs.field(default=0, init=False)
    recent_writes: deque[str] = attrs.field(factory=lambda: deque(maxlen=500), init=False)

    def _KubernetesEmulator__get_objs(self, request: Any, strict: bool) -> list[Any]:
        if request.name is not None and request.namespace is not None and request.resource is not None:
            key = (request.resource, request.namespace, request.name)
            return [self._objects[key]] if key in self._objects else []
        return super()._KubernetesEmulator__get_objs(request, strict)  # type: ignore[no-any-return]

    async def _handle(self, request: Any) -> Any:
        method = str(getattr(request.method, "value", request.method)).upper()
        if method in WRITES:
            self.write_count += 1
            self.recent_writes.append(f"{method} {request.url.path}")
        if len(self._requests) > 64:  # routing checks the newest request only, before any await
            del self._requests[:-16]
        return await super()._handle(request)


def _path(kind: str, namespace: str | None, name: str | None = None) -> str:
    plural = PLURALS[kind]
    group_version = next(key.rsplit("/", 1)[0] for key, (k, _, _) in RESOURCES.items() if k == kind)
    prefix = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    ns = f"/namespaces/{namespace}" if namespace and kind != "Namespace" else ""
    return f"{prefix}{ns}/{plural}" + (f"/{name}" if name else "")


def _merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        patch[key] = _merge_patch(before, value) if isinstance(value, dict) and isinstance(before, dict) else value
    return patch


class Kube:
    def __init__(self, url: str, kubeconfig: Path, emulator: Any) -> None:
        self.url, self.kubeconfig, self.emulator = url, kubeconfig, emulator
        self.http = httpx.Client(base_url=url, timeout=30)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create, or merge-patch the spec of an existing object (what `kubectl apply` amounts to here)."""
        meta = obj["metadata"]
        path = _path(obj["kind"], meta.get("namespace"), meta["name"])
        current = self.http.get(path)
        if current.status_code == 200:
            # kubectl apply removes the fields the new manifest no longer sets: null them in the merge patch.
            spec = _merge_patch(current.json().get("spec") or {}, obj.get("spec") or {})
            r = self.http.patch(path, json={"spec": spec, "metadata": {"labels": meta.get("labels", {})}},
                                headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
        else:
            # What an API server adds and kmock does not: kopf's patches test resourceVersion, and
            # the printer columns read creationTimestamp.
            stamped = {**meta, "resourceVersion": "1", "uid": str(uuid.uuid4()),
                       "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            r = self.http.post(_path(obj["kind"], meta.get("namespace")), json={**obj, "metadata": stamped})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    def writes(self) -> int:
        """Every write the emulator has served so far (POST, PUT, PATCH, DELETE), from anyone."""
        return int(self.emulator.write_count)

    def write_log(self) -> list[str]:
        """Method and path of the latest 500 writes, oldest first."""
        return list(self.emulator.recent_writes)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        r = self.http.get(_path(kind, namespace, name))
        if r.status_code == 404:
            return None
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        self.http.delete(_path(kind, namespace, name)).raise_for_status()

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
        return wait_for(what, check, timeout)


@contextmanager
def kube_emulator(folder: Path) -> Iterator[Kube]:
    """kmock on a free port in its own thread and event loop; a kubeconfig pointing at it in ``folder``."""
    started: dict[str, Any] = {}
    stop = threading.Event()

    async def serve() -> None:
        async with IndexedEmulator() as emulator, kmock.Server(emulator):
            for key, (kind, namespaced, subresources) in RESOURCES.items():
                emulator.resources[key] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources
                )
            started["url"] = str(emulator.url).rstrip("/")
            started["emulator"] = emulator
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while "url" not in started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("kmock did not start")
        time.sleep(0.02)
    url = started["url"]
    kubeconfig = folder / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "test", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
        "current-context": "kmock",
    }))  # fmt: skip
    try:
        yield Kube(url, kubeconfig, started["emulator"])
    finally:
        stop.set()
        thread.join(timeout=10)
