"""A real S3-compatible server on loopback (moto in server mode) for the cold-tier tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplane.serving.http.loopback import free_port

ACCESS, SECRET = "testing-access", "testing-secret"


@contextmanager
def moto_server() -> Iterator[str]:
    """Yields the endpoint URL of a fresh moto server; stops it afterwards."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def client(endpoint: str):  # type: ignore[no-untyped-def]
    from minio import Minio

    return Minio(endpoint.removeprefix("http://"), access_key=ACCESS, secret_key=SECRET, secure=False, region="us-east-1")


def upload_folder(endpoint: str, bucket: str, prefix: str, folder: Path) -> str:
    c = client(endpoint)
    if not c.bucket_exists(bucket):
        c.make_bucket(bucket)
    for f in sorted(folder.iterdir()):
        if f.is_file():
            c.fput_object(bucket, f"{prefix}/{f.name}", str(f))
    return f"s3://{bucket}/{prefix}"
