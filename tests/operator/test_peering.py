"""Two operators peering for HA against a real API server: the one with the higher priority reconciles, the
other stands by, and takes over as soon as the first leaves (a rolling update, a drained node)."""

from __future__ import annotations

import copy
import signal
import subprocess
from pathlib import Path

import pytest
from crd_schema import examples
from envtest import control_plane
from operator_process import start_operator

pytestmark = pytest.mark.slow
BASE = next(d for d in examples() if d["kind"] == "BaseModel")


def base_model(name: str) -> dict:
    manifest = copy.deepcopy(BASE)
    manifest["metadata"] = {"name": name, "namespace": "team-a"}
    return manifest


def test_the_standby_operator_takes_over_when_the_active_one_leaves(tmp_path: Path) -> None:
    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    def operator(name: str, priority: int) -> subprocess.Popen[bytes]:
        flags = ("--peering", "loraplane", "--priority", str(priority))
        return start_operator(kube.kubeconfig, tmp_path / f"{name}.log", peering=flags)

    with control_plane(tmp_path / "kube") as kube:
        kube.apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "loraplane"}})
        active = operator("active", 200)
        standby = operator("standby", 100)  # starts paused: kopf waits for the peering to say it may run
        try:
            kube.wait_for(
                "both in the peering", lambda: len(kube.get("ClusterKopfPeering", None, "loraplane").get("status", {})) == 2
            )
            kube.apply(base_model("first"))
            kube.wait_for("the active operator's children", lambda: kube.get("Deployment", "team-a", "first-serving"), timeout=30)
            # kopf logs each handler and timer run under kopf.objects: the standby has run none.
            kube.wait_for("the active operator's handler log", lambda: "kopf.objects" in log("active"), timeout=30)
            assert "kopf.objects" not in log("standby")

            active.send_signal(signal.SIGTERM)  # graceful: it withdraws from the peering on its way out
            active.wait(timeout=30)
            kube.wait_for("the standby to resume", lambda: "Resuming operations" in log("standby"), timeout=30)
            kube.apply(base_model("second"))
            kube.wait_for("the standby's children", lambda: kube.get("Deployment", "team-a", "second-serving"), timeout=30)
            # The children exist before the handler that made them returns and logs its success.
            kube.wait_for("the standby's handler log", lambda: "kopf.objects" in log("standby"), timeout=30)
        finally:
            for proc in (active, standby):
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
