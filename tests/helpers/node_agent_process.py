"""``loraplane node-agent`` and ``loraplane serve`` as real processes on loopback, as the DaemonSet
and a serving pod with a node cache run them."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from s3_server import ACCESS, SECRET
from waiting import wait_for

from loraplane.serving.bench.deployment import child_command
from loraplane.serving.http.loopback import free_port

TOKEN = "node-agent-test-token"


@contextmanager
def _cli_process(
    args: list[str], env: dict[str, str], port: int, ready_path: str, timeout: float,
    started: list[subprocess.Popen[str]] | None = None,
) -> Iterator[str]:  # fmt: skip
    """``python -m loraplane.cli ARGS``; yields its URL once ``ready_path`` answers 200, stops it
    afterwards (unless a test killed it: the process goes into ``started``). Its log goes to a
    file, not a pipe: a pipe nobody reads would fill with access lines and block the process."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(child_command(*args), env=env, stdout=subprocess.DEVNULL,
                                stderr=log, text=True)  # fmt: skip
        if started is not None:
            started.append(proc)

        def ready() -> bool:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"loraplane {args[0]} exited: {log.read()[-4000:]}")
            try:
                return httpx.get(f"{url}{ready_path}", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(f"loraplane {args[0]} to answer", ready, timeout=timeout)
            yield url
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=30)


@contextmanager
def node_agent(
    cache: Path, s3_endpoint: str, *args: str, node: str = "node-1", started: list[subprocess.Popen[str]] | None = None
) -> Iterator[str]:
    """The agent's URL once ``/health`` answers. ``args``: more flags; ``started``: gets the process."""
    port = free_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_REGION": "us-east-1", "LORAPLANE_ADMIN_TOKEN": TOKEN, "NODE_NAME": node}  # fmt: skip
    command = ["node-agent", "--cache-dir", str(cache), "--host", "127.0.0.1", "--port", str(port), *args]
    with _cli_process(command, env, port, "/health", timeout=60, started=started) as url:
        yield url


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
    command = ["serve", "--config", str(scratch / "engine.yaml"), "--model", str(base), "--served-model-name", name,
               "--port", str(port)]  # fmt: skip
    with _cli_process(command, env, port, "/ready", timeout=120) as url:
        yield url
