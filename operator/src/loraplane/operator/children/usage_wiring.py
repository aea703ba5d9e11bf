"""How a BaseModel's serving and router pods spool and export their usage records."""

from __future__ import annotations

from typing import Any

from loraplane.operator.api.basemodel import BaseModelSpec

USAGE_DIR = "/var/lib/loraplane/usage"
# Hours of records at a busy replica's rate (8 MiB segments) while the export is down; past it the
# kubelet evicts the pod, which beats filling the node's disk (that evicts every pod on it).
USAGE_VOLUME: dict[str, Any] = {"name": "usage", "emptyDir": {"sizeLimit": "2Gi"}}


def usage_wiring(spec: BaseModelSpec) -> tuple[list[str], list[dict[str, Any]]]:
    """The usage spool's arguments and environment for a serving or router container. The spool
    sits on an ``emptyDir``: it survives a container crash (the restarted container exports what
    the crashed one closed or left open), and graceful shutdown exports the last segment."""
    u = spec.usage
    args = ["--usage-dir", USAGE_DIR, "--usage-segment-age", str(u.segment_age_seconds),
            "--usage-fsync-interval", f"{u.fsync_interval_seconds:g}"]  # fmt: skip
    env: list[dict[str, Any]] = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    if u.bucket:
        destination = "/".join(p for p in (u.bucket, u.prefix.strip("/")) if p)
        env.append({"name": "LORAPLANE_USAGE_EXPORT", "value": f"s3://{destination}"})
        store = spec.adapter_store
        if store.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL", "value": store.endpoint})
        if store.region:
            env.append({"name": "AWS_REGION", "value": store.region})
    return args, env
