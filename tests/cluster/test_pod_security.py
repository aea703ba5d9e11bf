"""Pod Security Admission as the API server applies it: the namespaces the stack runs in could
be labelled `restricted`, the strictest level, without one of the chart's or the operator's pods
violating it. The server judges, not our reading of the standard: a server-side dry run of the
label warns about every existing pod the level would refuse (a pod with a hostPath, the control
here, is named). The node cache is the exception the docs state: its agents mount a hostPath, so a
base with `nodeCache.enabled` needs a privileged namespace."""

from __future__ import annotations

import json
import secrets
import subprocess
from typing import Any

import pytest
from kubectl import RELEASE_NS, SKIP_REASON, enabled, kubectl, running_pods

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not enabled(), reason=SKIP_REASON)]
CONTROL_NS = f"pod-security-control-{secrets.token_hex(3)}"  # a run's own: the last one may still be going


def warnings_for(namespace: str, level: str = "restricted") -> str:
    """What the API server warns when ``namespace`` would enforce ``level``; nothing is changed."""
    r = subprocess.run(["kubectl", "label", "namespace", namespace, f"pod-security.kubernetes.io/enforce={level}",
                        "--dry-run=server", "--overwrite"], capture_output=True, text=True, check=True)  # fmt: skip
    return r.stderr


def test_the_stack_runs_under_the_restricted_level_and_the_check_names_a_pod_that_does_not(
    story: dict[str, Any],
) -> None:
    operator = running_pods(RELEASE_NS, "app.kubernetes.io/component=operator")
    serving = running_pods(story["ns"], story["serving"])
    assert operator and serving
    for namespace in (RELEASE_NS, story["ns"]):
        assert "violate" not in warnings_for(namespace), warnings_for(namespace)

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "host-path", "namespace": CONTROL_NS},
           "spec": {"containers": [{"name": "c", "image": serving[0]["spec"]["containers"][0]["image"],
                                    "command": ["sleep", "600"], "volumeMounts": [{"name": "h", "mountPath": "/h"}]}],
                    "volumes": [{"name": "h", "hostPath": {"path": "/tmp"}}]}}  # fmt: skip
    kubectl("create", "namespace", CONTROL_NS)
    try:
        subprocess.run(["kubectl", "create", "-f", "-"], input=json.dumps(pod), text=True, check=True, capture_output=True)
        warned = warnings_for(CONTROL_NS)
        assert "violate" in warned and "host-path:" in warned and "restricted volume types" in warned, warned
        assert "hostPath volumes" in warnings_for(CONTROL_NS, "baseline")  # what keeps the node cache out of it
    finally:
        kubectl("delete", "namespace", CONTROL_NS, "--wait=false", check=False)
