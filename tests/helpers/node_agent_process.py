"""``loraplane node-agent`` as a real process on loopback, as the DaemonSet runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from s3_server import ACCESS, SECRET
from waiting import wait_for

from loraplane.serving.api.loopback import free_port

TOKEN = "node-agent-test-token"


@contextmanager
def node_agent(cache: Path, s3_endpoint: str, *args: str, node: str = "node-1") -> Iterator[str]:
    """Yields the agent's URL once ``/health`` answers; stops it afterwards. ``args``: more flags."""
    port = free_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_REGION": "us-east-1", "LORAPLANE_ADMIN_TOKEN": TOKEN, "NODE_NAME": node}  # fmt: skip
    command = [sys.executable, "-m", "loraplane.cli", "node-agent", "--cache-dir", str(cache), "--host", "127.0.0.1",
               "--port", str(port), *args]  # fmt: skip
    # A file, not a pipe: a pipe nobody reads would fill with access lines and block the agent.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"node-agent exited: {log.read()[-4000:]}")
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for("the node agent to answer", healthy, timeout=60)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=15)


def call(url: str, method: str, path: str, body: object = None) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
