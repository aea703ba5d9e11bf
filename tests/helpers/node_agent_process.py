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


@contextmanager
def serving_process(base: Path, name: str, node_cache: Path, agent: str, scratch: Path) -> Iterator[str]:
    """``loraplane serve`` as the serving pod runs it with a node cache: the base opened from the
    node's copy, adapters through the agent, no object-store settings of its own. Yields its URL
    once ``/ready`` answers."""
    import yaml

    scratch.mkdir(parents=True, exist_ok=True)
    config = {"node_cache_url": agent, "node_cache_dir": str(node_cache), "cache_dir": str(scratch), "dtype": "float32",
              "max_loras": 2, "max_lora_rank": 16, "block_size": 4, "num_kv_blocks": 256}  # fmt: skip
    (scratch / "engine.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # a pod without the store's credentials
    env["LORAPLANE_ADMIN_TOKEN"] = TOKEN
    command = [sys.executable, "-m", "loraplane.cli", "serve", "--config", str(scratch / "engine.yaml"), "--model", str(base),
               "--served-model-name", name, "--port", str(port)]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"serve exited: {log.read()[-4000:]}")
            try:
                return httpx.get(f"{url}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for("the serving process to be ready", ready, timeout=120)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)
