"""The optional MinIO: off by default, its credentials are the pair loraplane reads, its data on a
volume that survives the pod unless persistence is off, and its bucket Job really creates buckets."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from s3_server import ACCESS, SECRET, client, moto_server

ON = {"objectStore": {"enabled": True}}


def test_off_by_default(render: Any) -> None:
    assert [o for o in render() if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "object-store"] == []


def test_minio_takes_the_same_credentials_the_engine_and_operator_read(render: Any) -> None:
    objects = render(ON)
    secret = objects.one("Secret", "loraplane-object-store")
    minio = objects.one("Deployment", "loraplane-object-store")["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in minio["env"] if "valueFrom" in e}
    assert refs == {
        "MINIO_ROOT_USER": {"name": "loraplane-object-store", "key": "AWS_ACCESS_KEY_ID"},
        "MINIO_ROOT_PASSWORD": {"name": "loraplane-object-store", "key": "AWS_SECRET_ACCESS_KEY"},
    }
    assert set(secret["data"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def test_an_existing_secret_replaces_the_generated_one(render: Any) -> None:
    objects = render({"objectStore": {"enabled": True, "existingSecret": "s3-creds"}})
    assert objects.kind("Secret") == []
    job = objects.one("Job")["spec"]["template"]["spec"]["containers"][0]
    assert job["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]


def test_data_lives_on_a_kept_claim_unless_persistence_is_off(render: Any) -> None:
    objects = render(ON)
    claim = objects.one("PersistentVolumeClaim")
    volumes = objects.one("Deployment", "loraplane-object-store")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in volumes
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    ephemeral = render({"objectStore": {"enabled": True, "persistence": {"enabled": False}}})
    assert ephemeral.kind("PersistentVolumeClaim") == []
    pod = ephemeral.one("Deployment", "loraplane-object-store")["spec"]["template"]["spec"]
    assert {"name": "data", "emptyDir": {"sizeLimit": "10Gi"}} in pod["volumes"]  # persistence.size bounds it


def test_the_bucket_job_creates_the_buckets_and_can_run_again(render: Any) -> None:
    job = render({"objectStore": {"enabled": True, "buckets": ["adapters", "goldens"]}}).one("Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "-c"]
    with moto_server() as endpoint:
        env = {"ENDPOINT": endpoint.removeprefix("http://"), "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET}
        first = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        again = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and again.stdout == "", again.stderr  # after an upgrade: nothing to do
        assert sorted(b.name for b in client(endpoint).list_buckets()) == ["adapters", "goldens"]
