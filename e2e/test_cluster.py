"""The same story against a real cluster: `make e2e-cluster` (see e2e/README.md for a kind cluster,
the images and `helm install`). Skipped unless LORAPLANE_E2E_CLUSTER=1, a kubeconfig and kubectl
are present: this test creates and deletes objects in whatever cluster the kubeconfig names.

It drives the cluster only the way a user would, with `kubectl` (apply, get, port-forward) and the
official client through the router Service the operator created."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from scenario import daily_promotion, example_manifests, status_of, wait_for

from loraplane.serving.http.loopback import free_port

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("LORAPLANE_E2E_CLUSTER") != "1" or shutil.which("kubectl") is None,
        reason="a real-cluster test: set LORAPLANE_E2E_CLUSTER=1 with a kubeconfig and kubectl (make e2e-cluster)",
    ),
]
RELEASE_NS = os.environ.get("LORAPLANE_E2E_RELEASE_NAMESPACE", "loraplane")
RELEASE = os.environ.get("LORAPLANE_E2E_RELEASE", "loraplane")


class Kubectl:
    """apply and get through kubectl itself: the real `kubectl apply` semantics."""

    def apply(self, obj: dict[str, Any]) -> None:
        subprocess.run(["kubectl", "apply", "-f", "-"], input=yaml.safe_dump(obj).encode(), check=True, capture_output=True)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        args = ["kubectl", "get", kind.lower(), name, "-o", "json"] + (["-n", namespace] if namespace else [])
        r = subprocess.run(args, capture_output=True)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def secret(self, namespace: str, name: str) -> dict[str, str]:
        obj = self.get("Secret", namespace, name)
        assert obj is not None, f"Secret {namespace}/{name} is missing: is the chart installed with objectStore.enabled?"
        return {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}


@contextmanager
def port_forward(namespace: str, target: str, port: int) -> Iterator[str]:
    local = free_port()
    proc = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, target, f"{local}:{port}"], stdout=subprocess.PIPE)
    try:
        time.sleep(2)
        assert proc.poll() is None, f"kubectl port-forward {target} exited"
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()


def test_the_daily_promotion_story_on_a_real_cluster() -> None:
    import torch

    from loraplane.adapter_format import adapter_digest
    from loraplane.serving.config import default_cache_dir
    from loraplane.serving.lora.synthetic import PEFT_DEFAULT, write_adapter
    from loraplane.serving.weights.base import resolve_base

    kube = Kubectl()
    base, adapters = example_manifests()
    ns, base_name = base["metadata"]["namespace"], base["metadata"]["name"]
    store = kube.secret(RELEASE_NS, f"{RELEASE}-object-store")
    tenants = {"tenants": [{"name": t, "api_keys": [f"sk-e2e-{t}"]} for t in sorted({a["spec"]["tenant"] for a in adapters})]}
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    for name, data in {
        base["spec"]["adapterStore"]["credentialsSecret"]["name"]: store,
        base["spec"]["tenancy"]["apiKeysSecret"]["name"]: {"tenants.yaml": yaml.safe_dump(tenants)},
    }.items():
        kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "stringData": data})

    shape = resolve_base("embedded", default_cache_dir()).shape
    from minio import Minio

    versions: dict[str, tuple[str, str]] = {}
    applied = []
    with tempfile.TemporaryDirectory() as tmp, port_forward(RELEASE_NS, f"svc/{RELEASE}-object-store", 9000) as s3:
        client = Minio(s3.removeprefix("http://"), access_key=store["AWS_ACCESS_KEY_ID"],
                       secret_key=store["AWS_SECRET_ACCESS_KEY"], secure=False)  # fmt: skip

        def upload(prefix: str, seed: int) -> tuple[str, str]:
            folder = write_adapter(Path(tmp) / prefix, shape, 8, PEFT_DEFAULT, seed=seed, dtype=torch.bfloat16)
            for f in folder.iterdir():
                client.fput_object("adapters", f"{prefix}/{f.name}", str(f))
            return f"s3://adapters/{prefix}", adapter_digest(folder)

        for i, a in enumerate(adapters):
            spec = {k: v for k, v in a["spec"].items() if k not in ("rank", "targetModules", "qualityGate")}
            uri, digest = upload(f"{spec['tenant']}/{a['metadata']['name']}/v1", i + 1)
            applied.append({**a, "spec": {**spec, "source": {"uri": uri, "digest": digest}}})
        versions["v1"] = (applied[0]["spec"]["source"]["uri"], applied[0]["spec"]["source"]["digest"])
        versions["v2"] = upload(f"{applied[0]['spec']['tenant']}/{applied[0]['metadata']['name']}/v2", 101)
        versions["broken"] = (upload("broken/v3", 102)[0], versions["v2"][1])

    endpoint = f"http://{RELEASE}-object-store.{RELEASE_NS}.svc:9000"
    kube.apply({**base, "spec": {**base["spec"], "adapterStore": {**base["spec"]["adapterStore"], "endpoint": endpoint}}})
    for manifest in applied:
        kube.apply(manifest)
    for manifest in applied:
        name = manifest["metadata"]["name"]
        wait_for(f"{name} Ready", lambda name=name: status_of(kube, ns, name).get("phase") == "Ready", 900)

    with port_forward(ns, f"svc/{base_name}-router", 8000) as router:
        first = applied[0]
        key = next(t["api_keys"][0] for t in tenants["tenants"] if t["name"] == first["spec"]["tenant"])
        client_ = openai.OpenAI(base_url=f"{router}/v1", api_key=key, max_retries=0, timeout=120)
        traffic, refusal = daily_promotion(kube, first, client_, versions, timeout=600)
    assert traffic.failures == [] and refusal["reason"] == "DigestMismatch"
