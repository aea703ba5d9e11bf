"""The real `loraplane operator` as a child process against a test's Kubernetes API server (envtest.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from loraplane.serving.bench.deployment import child_command
from loraplane.serving.http.loopback import free_port


def start_operator(
    kubeconfig: Path,
    log_path: Path,
    timeout: float = 60,
    peering: tuple[str, ...] = ("--standalone",),
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Started and answering its liveness endpoint; syncs every second so tests do not wait.
    ``peering``: the flags that choose standalone or peering (``--peering NAME --priority N``);
    ``extra_args``: more flags (``--namespace NS`` to watch only that one, ``--webhook-port P``);
    ``extra_env``: more environment."""
    port = free_port()
    env = dict(os.environ, KUBECONFIG=str(kubeconfig),
               LORAPLANE_SYNC_INTERVAL="1", LORAPLANE_METRICS_INTERVAL="0", LORAPLANE_METRICS_REFRESH="2",
               LORAPLANE_RETRY_DELAY="1", LORAPLANE_RESYNC_INTERVAL="10", **(extra_env or {}))  # fmt: skip
    args = ["operator", *peering, *extra_args, "--liveness", f"http://127.0.0.1:{port}/healthz"]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(child_command(*args), env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the operator's liveness endpoint did not answer:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM (kopf's graceful exit), then SIGKILL if it has not exited after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
