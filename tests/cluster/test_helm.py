"""The chart's life with a real `helm` (helm.sh/helm/v4, tools/helm/) on a real cluster: a values
change rolls the operator, a rollback restores it, and an uninstall keeps the CRDs and every
BaseModel and LoraAdapter, as charts/README.md promises. Last in the cluster run: it uninstalls."""

from __future__ import annotations

import json

import pytest
from kubectl import CHART, LOCAL_VALUES, RELEASE, RELEASE_NS, SKIP_REASON, enabled, get, helm, kubectl, running_pods
from waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not enabled(), reason=SKIP_REASON)]
OPERATOR = "app.kubernetes.io/component=operator"


def operator_env(unlike: str | None = None) -> dict[str, str]:
    """The environment of the one Ready operator pod (one replica, Recreate), once there is one
    other than the pod named ``unlike`` (the one a rollout replaces)."""

    def one() -> dict[str, str] | None:
        pods = running_pods(RELEASE_NS, OPERATOR)
        if len(pods) != 1 or pods[0]["metadata"]["name"] == unlike:
            return None
        env = {e["name"]: e.get("value", "") for e in pods[0]["spec"]["containers"][0].get("env", [])}
        return env | {"pod": pods[0]["metadata"]["name"]}

    found: dict[str, str] = wait_for("one Ready operator pod" + (f" other than {unlike}" if unlike else ""), one, 180)
    return found


def revisions() -> list[dict[str, object]]:
    history: list[dict[str, object]] = json.loads(helm("history", RELEASE, "-n", RELEASE_NS, "-o", "json"))
    return history


def test_a_values_change_rolls_the_operator_and_a_rollback_restores_it() -> None:
    before = operator_env()
    assert before["LORAPLANE_SYNC_INTERVAL"] == "10"
    helm("upgrade", RELEASE, str(CHART), "-n", RELEASE_NS, "-f", str(LOCAL_VALUES), "--set", "operator.syncInterval=7",
         "--wait", "--timeout", "5m")  # fmt: skip
    after = operator_env(unlike=before["pod"])
    assert after["LORAPLANE_SYNC_INTERVAL"] == "7"
    assert [r["status"] for r in revisions()][-1] == "deployed" and len(revisions()) == 2

    helm("rollback", RELEASE, "1", "-n", RELEASE_NS, "--wait", "--timeout", "5m")
    restored = operator_env(unlike=after["pod"])
    assert restored["LORAPLANE_SYNC_INTERVAL"] == "10"
    history = revisions()
    assert len(history) == 3 and history[-1]["status"] == "deployed" and "Rollback to 1" in str(history[-1]["description"])


def test_uninstall_keeps_the_crds_and_every_users_object() -> None:
    before = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in get("loraadapters", None, None, None, True)["items"]}
    helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "5m")
    assert kubectl("get", "deployments", "-n", RELEASE_NS, "-l", OPERATOR, "-o", "name").strip() == ""
    for crd in ("basemodels.loraplane.dev", "loraadapters.loraplane.dev"):
        assert get("crd", None, crd)["metadata"]["name"] == crd
    after = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in get("loraadapters", None, None, None, True)["items"]}
    assert after == before
