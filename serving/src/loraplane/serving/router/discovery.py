"""Which replicas exist: a static list of URLs, or the EndpointSlices of the serving Service,
watched, so that a pod that becomes ready (or goes away) is in (or out of) the table within a
second, with no restart of the router."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"


def static_members(urls: Iterable[str]) -> dict[str, str]:
    """Name each replica by its host and port, which is what a person reads in the metrics."""
    members: dict[str, str] = {}
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{url!r} is not an http(s) URL")
        members[parts.netloc] = url.rstrip("/")
    if not members:
        raise ValueError("give at least one replica URL")
    return members


def slice_members(slices: Iterable[dict[str, Any]], scheme: str = "http") -> dict[str, str]:
    """Ready endpoints of the slices (plain dicts, as the API returns them) as name -> URL; a pod
    is named by its Pod, so its metrics keep their label while its IP changes."""
    members: dict[str, str] = {}
    for s in slices:
        ports = s.get("ports") or []
        port = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else None)
        if port is None or port.get("port") is None:
            continue
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
                continue
            address = ep["addresses"][0]
            host = f"[{address}]" if ":" in address else address
            name = (ep.get("targetRef") or {}).get("name") or address
            members[name] = f"{scheme}://{host}:{port['port']}"
    return members


class EndpointSliceWatch:
    """Lists, then watches, the Service's EndpointSlices in a thread (the kubernetes client is
    synchronous) and calls ``publish`` with the full membership after every change."""

    def __init__(self, api_client: Any, namespace: str, service: str, publish: Callable[[dict[str, str]], None]) -> None:
        self.api_client, self.namespace, self.service, self.publish = api_client, namespace, service, publish
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _ours(self, obj: dict[str, Any]) -> bool:
        # Filtered here as well as by the selector: the selector is a request, not a guarantee.
        return ((obj.get("metadata") or {}).get("labels") or {}).get(SERVICE_LABEL) == self.service

    def _run(self) -> None:
        from kubernetes import client
        from kubernetes import watch as untyped_watch

        watch_module: Any = untyped_watch

        api: Any = client.DiscoveryV1Api(self.api_client)  # the client is untyped
        selector = f"{SERVICE_LABEL}={self.service}"
        backoff = 0.5
        while not self.stopped.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector, _preload_content=False)
                body = json.loads(listed.data)
                slices = {s["metadata"]["name"]: s for s in body.get("items", []) if self._ours(s)}
                self.publish(slice_members(slices.values()))
                version = (body.get("metadata") or {}).get("resourceVersion")
                w: Any = watch_module.Watch()
                for event in w.stream(
                    api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                    resource_version=version, timeout_seconds=60, deserialize=False,
                ):  # fmt: skip
                    if self.stopped.is_set():
                        w.stop()
                        return
                    obj = event["object"]
                    if event["type"] not in ("ADDED", "MODIFIED", "DELETED") or not self._ours(obj):
                        continue
                    if event["type"] == "DELETED":
                        slices.pop(obj["metadata"]["name"], None)
                    else:
                        slices[obj["metadata"]["name"]] = obj
                    self.publish(slice_members(slices.values()))
                backoff = 0.5
            except Exception as err:  # the API server restarts, the watch expires (410): list again
                log.warning("watching EndpointSlices of %s/%s: %r; retrying", self.namespace, self.service, err)
                self.stopped.wait(backoff)
                backoff = min(backoff * 2, 10.0)
