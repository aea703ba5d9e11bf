"""The security context of every pod the operator creates (serving replicas and routers), the
same as the chart gives the operator's own: non-root (the images run as uid 10001), the runtime's
default seccomp profile, no privilege escalation, no capabilities, a read-only root filesystem.
What the processes write goes to volumes: the caches and usage spools they already mount, and an
``emptyDir`` at /tmp, which is also HOME, so library caches (Triton's kernels, numba's) land there.
"""

from __future__ import annotations

from typing import Any

POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# Library caches only (Triton's compiled kernels are a few MB each): a runaway writer is evicted
# by the kubelet before it fills the node's disk.
TMP_VOLUME: dict[str, Any] = {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
TMP_MOUNT: dict[str, Any] = {"name": "tmp", "mountPath": "/tmp"}
HOME_ENV: dict[str, Any] = {"name": "HOME", "value": "/tmp"}
