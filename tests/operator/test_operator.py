"""The real operator process (`loraplane operator`) against a real Kubernetes API server (envtest.py:
etcd and kube-apiserver, our CRDs and the operator's ClusterRole), with real serving replicas on
loopback (tiny model; their Pod objects point at the local ports) and a real S3 server (moto). The
operator holds only the ClusterRole's permissions, and the server validates every manifest."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from broken_adapters import corrupt
from engine_helpers import tiny_engine
from envtest import Kube, control_plane
from flaky_proxy import FlakyProxy, flaky_proxy
from operator_process import start_operator
from s3_server import ACCESS, SECRET, moto_server, upload_folder
from serving_pods import admin_secret, serving_pod
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from loraplane.adapter_format import AdapterValidationError, ErrorCode, adapter_digest, file_digest
from loraplane.operator.children.dedicated import DEDICATED_LABEL
from loraplane.operator.children.names import (
    ADMIN_TOKEN_KEY,
    STAGED_CONDITION,
    STATS_TOKEN_KEY,
    admin_secret_name,
    stats_secret_name,
)
from loraplane.serving.api.app import create_app
from loraplane.serving.config import EngineConfig
from loraplane.serving.http.loopback import serve_app

NS = "team-a"
ADMIN = "admin-secret"
pytestmark = pytest.mark.slow


def digest_of(folder: Path) -> str:
    return adapter_digest(folder)


@dataclass
class Stack:
    kube: Kube
    endpoint: str  # the object store as the operator and the replicas reach it: moto behind ``store``
    store: FlakyProxy
    tiny_llama: Path
    folder: Path
    uris: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    weights_digests: dict[str, str] = field(default_factory=dict)  # the earlier form: adapter_model.safetensors alone
    replicas: dict[str, str] = field(default_factory=dict)  # pod name -> URL
    engines: dict[str, Any] = field(default_factory=dict)  # pod name -> the engine its app serves (built here)
    operator: subprocess.Popen[bytes] | None = None
    exits: ExitStack = field(default_factory=ExitStack)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kube.apply(manifest)

    def start_replica(self, name: str) -> str:
        cache = self.folder / f"cache-{name}"

        def make():  # type: ignore[no-untyped-def]
            engine = self.engines[name] = tiny_engine(
                self.tiny_llama, cache, max_loras=3, max_lora_rank=8, s3_endpoint=self.endpoint, s3_access_key=ACCESS,
                s3_secret_key=SECRET, s3_region="us-east-1",
            )  # fmt: skip
            return engine

        app = create_app(make, admin_token=ADMIN)
        url = self.exits.enter_context(serve_app(app))
        self.replicas[name] = url
        self.apply(serving_pod(name, NS, "tiny", url))
        return url

    def start_operator(self) -> None:
        self.operator = start_operator(self.kube.kubeconfig, self.folder / "operator.log")

    def stop_operator(self, sig: int = signal.SIGTERM) -> None:
        assert self.operator is not None
        self.operator.send_signal(sig)
        self.operator.wait(timeout=30)

    def log(self) -> str:
        return (self.folder / "operator.log").read_text()[-4000:]

    def adapter(self, name: str) -> dict[str, Any]:
        obj = self.kube.get("LoraAdapter", NS, name)
        assert obj is not None
        return obj

    def wait_phase(self, name: str, phase: str, timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            obj = self.kube.get("LoraAdapter", NS, name)
            return obj if obj and obj.get("status", {}).get("phase") == phase else None

        try:
            return self.kube.wait_for(f"{name} to be {phase}", check, timeout)  # type: ignore[no-any-return]
        except AssertionError:
            raise AssertionError(f"{self.kube.get('LoraAdapter', NS, name)}\n--- operator log ---\n{self.log()}") from None

    def on_replica(self, url: str, served: str) -> dict[str, Any] | None:
        r = httpx.get(f"{url}/admin/adapters/{served}", headers={"Authorization": f"Bearer {ADMIN}"})
        return r.json() if r.status_code == 200 else None


def lora(name: str, uri: str, digest: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "loraplane.dev/v1alpha1", "kind": "LoraAdapter",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"baseModel": "tiny", "tenant": "acme", "source": {"uri": uri, "digest": digest}, **spec},
    }  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("operator")
    with ExitStack() as outer:
        endpoint = outer.enter_context(moto_server())
        store = outer.enter_context(flaky_proxy(endpoint))
        kube = outer.enter_context(control_plane(folder / "kube"))
        s = Stack(kube, store.url, store, tiny_llama, folder)
        outer.enter_context(s.exits)
        for name, path in tiny_adapters.items():
            s.uris[name] = upload_folder(endpoint, "adapters", f"acme/{name}", path)
            s.digests[name] = digest_of(path)
            s.weights_digests[name] = file_digest(path / "adapter_model.safetensors")
        for how in ("base", "missing", "nan", "pickle"):
            bad = corrupt(tiny_adapters["qv4"], folder / f"bad-{how}", how)
            s.uris[how] = upload_folder(endpoint, "adapters", f"broken/{how}", bad)
            s.digests[how] = digest_of(tiny_adapters["qv4"]) if how == "missing" else digest_of(bad)
        # Golden outputs this base would never produce (always token 1): the quality gate must fail it.
        drifted = shutil.copytree(tiny_adapters["qv4"], folder / "bad-drifted")
        cases = [{"prompt_token_ids": [5, 6, 7], "greedy_token_ids": [1] * 8}]
        (drifted / "golden_outputs.json").write_text(json.dumps({"cases": cases}))
        s.uris["drifted"] = upload_folder(endpoint, "adapters", "broken/drifted", drifted)
        s.digests["drifted"] = digest_of(drifted)
        secret = {
            k: base64.b64encode(v.encode()).decode()
            for k, v in {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET}.items()
        }
        s.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "adapter-store", "namespace": NS}, "data": secret})
        s.apply(admin_secret(NS, "tiny", ADMIN))  # the replicas' token, brought before the BaseModel
        s.apply({
            "apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny", "namespace": NS},
            "spec": {
                "source": {"uri": str(tiny_llama)}, "replicas": 2,
                "engine": {"maxLoras": 3, "maxLoraRank": 8, "maxCpuLoras": 8},
                "adapterStore": {"endpoint": store.url, "region": "us-east-1", "credentialsSecret": {"name": "adapter-store"}},
                "autoPinning": {"enabled": False},
            },
        })  # fmt: skip
        s.start_replica("tiny-serving-0")
        s.start_replica("tiny-serving-1")
        s.start_operator()
        try:
            yield s
        finally:
            if s.operator is not None and s.operator.poll() is None:
                s.stop_operator()


def test_a_valid_adapter_is_validated_staged_and_ready_on_every_replica(stack: Stack, tiny_adapters: dict[str, Path]) -> None:
    quotas = {"maxConcurrent": 50, "tokensPerMinute": 100_000}
    stack.apply(lora("support", stack.uris["qv4"], stack.digests["qv4"], rank=4, pinned=True, quotas=quotas))
    obj = stack.wait_phase("support", "Ready")
    status = obj["status"]
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "Validated": ("True", "Valid"), "Staged": ("True", "Staged"), "Pinned": ("True", "Pinned"),
        "Ready": ("True", "Serving"),
    }  # fmt: skip
    assert status["servingDigest"] == stack.digests["qv4"] and status["rank"] == 4 and status["pinned"] is True
    # Declared by its adapter digest, which covers the config and the golden outputs as well.
    validated = next(c for c in status["conditions"] if c["type"] == "Validated")
    assert status["adapterDigest"] == adapter_digest(tiny_adapters["qv4"]) == stack.digests["qv4"]
    assert "declare" not in validated["message"]
    assert sorted(r["replica"] for r in status["replicas"]) == ["tiny-serving-0", "tiny-serving-1"]
    for url in stack.replicas.values():
        state = stack.on_replica(url, "support")
        assert state is not None and state["tenant"] == "acme" and state["pinned"] and state["digest"] == stack.digests["qv4"]
        assert state["quotas"] == {"max_concurrent": 50, "tokens_per_minute": 100_000}  # enforced by the replica

        def staged(url: str = url) -> bool:  # prefetch runs in the background; pinned adapters end on the device
            state = stack.on_replica(url, "support")
            return state is not None and state["tier"] in ("host", "device")

        stack.kube.wait_for(f"the prefetch to land: {stack.on_replica(url, 'support')}", staged, timeout=20)


def test_the_base_model_owns_its_serving_deployment_service_config_and_router(stack: Stack) -> None:
    deployment = stack.kube.wait_for(
        "the serving Deployment", lambda: stack.kube.get("Deployment", NS, "tiny-serving"), timeout=20
    )
    base = stack.kube.get("BaseModel", NS, "tiny")
    assert base is not None
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == base["metadata"]["uid"]
    assert deployment["spec"]["replicas"] == 2
    assert stack.kube.get("Service", NS, "tiny-serving") is not None
    config = stack.kube.get("ConfigMap", NS, "tiny-engine")
    assert config is not None and "max_lora_rank: 8" in config["data"]["engine.yaml"]
    for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"):  # and the router in front
        router = stack.kube.wait_for(f"the router {kind}", lambda k=kind: stack.kube.get(k, NS, "tiny-router"), timeout=20)
        assert router["metadata"]["ownerReferences"][0]["uid"] == base["metadata"]["uid"]

    def status() -> dict[str, Any] | None:
        s = (stack.kube.get("BaseModel", NS, "tiny") or {}).get("status", {})
        return s if s.get("readyReplicas") == len(stack.replicas) and s.get("fingerprint") else None

    s = stack.kube.wait_for("the BaseModel's status", status, timeout=20)
    assert s["phase"] == "Ready" and next(c for c in s["conditions"] if c["type"] == "Applied")["status"] == "True"


def test_each_base_model_gets_its_own_admin_token_and_a_brought_one_is_kept(stack: Stack) -> None:
    other = {"apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModel", "metadata": {"name": "other", "namespace": NS},
             "spec": {"source": {"uri": str(stack.tiny_llama)}, "replicas": 1}}  # fmt: skip
    stack.apply(other)
    try:
        secret = stack.kube.wait_for(
            "other's admin Secret", lambda: stack.kube.get("Secret", NS, admin_secret_name("other")), timeout=20
        )
        owner = stack.kube.get("BaseModel", NS, "other")
        assert owner is not None and secret["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        token = base64.b64decode(secret["data"][ADMIN_TOKEN_KEY]).decode()
        assert len(token) >= 32 and token != ADMIN
        stats = stack.kube.wait_for(
            "other's stats Secret", lambda: stack.kube.get("Secret", NS, stats_secret_name("other")), timeout=20
        )
        assert stats["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        assert base64.b64decode(stats["data"][STATS_TOKEN_KEY]).decode() not in (token, ADMIN)
        pods = stack.kube.get("Deployment", NS, "other-serving")
        assert pods is not None
        env = pods["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": admin_secret_name("other"), "key": ADMIN_TOKEN_KEY} in [
            e["valueFrom"]["secretKeyRef"] for e in env if "secretKeyRef" in e.get("valueFrom", {})
        ]
    finally:
        stack.kube.delete("BaseModel", NS, "other")
    brought = stack.kube.get("Secret", NS, admin_secret_name("tiny"))  # the replicas' token: never rewritten
    assert brought is not None and base64.b64decode(brought["data"][ADMIN_TOKEN_KEY]).decode() == ADMIN


def test_the_admin_token_goes_only_to_a_pods_own_address(stack: Stack) -> None:
    """An annotation (a namespace user can write one) used to override the admin URL: the token went
    wherever it pointed. Now only the pod's IP and its container's http port are called."""
    calls: dict[str, list[str | None]] = {"pod": [], "elsewhere": []}

    def recorder(key: str) -> Starlette:
        async def ready(_: Request) -> JSONResponse:
            return JSONResponse({})

        async def record(request: Request) -> JSONResponse:
            calls[key].append(request.headers.get("authorization"))
            return JSONResponse({"error": {"message": "not a replica"}}, status_code=503)

        return Starlette(routes=[Route("/ready", ready), Route("/{path:path}", record, methods=["GET", "POST", "PUT", "DELETE"])])

    with serve_app(recorder("pod")) as pod_url, serve_app(recorder("elsewhere")) as elsewhere:
        name = "tiny-serving-impostor"
        stack.apply(serving_pod(name, NS, "tiny", pod_url, annotations={"loraplane.dev/admin-url": elsewhere}))
        try:
            stack.kube.wait_for("a sync to call the pod", lambda: calls["pod"], timeout=20)
        finally:
            stack.kube.delete("Pod", NS, name)
    assert calls["elsewhere"] == []


def test_request_figures_reach_the_adapters_status(stack: Stack) -> None:
    stack.wait_phase("support", "Ready")
    client = openai.OpenAI(base_url=f"{stack.replicas['tiny-serving-0']}/v1", api_key="none", max_retries=0)
    for _ in range(3):
        client.completions.create(model="support", prompt="hello there", max_tokens=4, extra_body={"ignore_eos": True})

    def figures() -> dict[str, Any] | None:
        m = stack.adapter("support").get("status", {}).get("metrics")
        return m if m and m["completionTokens"] == 12 else None

    metrics = stack.kube.wait_for("metrics in status", figures, timeout=30)
    assert metrics["deviceHitRate"] is not None and metrics["lastUpdated"]
    assert metrics["loadLatencyP99Ms"] >= metrics["loadLatencyP50Ms"] > 0  # the first request loaded it


GATE = {"qualityGate": {"minTokenAgreement": 0.9}}


@pytest.mark.parametrize(
    ("how", "reason", "spec"),
    [("digest", "DigestMismatch", {}), ("weights-only", "DigestMismatch", {}), ("base", "BaseMismatch", {}),
     ("rank", "RankOverCap", {}),
     ("missing", "MissingFile", {}), ("nan", "CorruptSafetensors", {}), ("pickle", "PickleRefused", {}),
     ("drifted", "QualityGateFailed", GATE), ("no-golden", "GoldenOutputsMissing", GATE)],
)  # fmt: skip
def test_a_bad_adapter_fails_alone_with_its_reason(stack: Stack, how: str, reason: str, spec: dict[str, Any]) -> None:
    uri, digest = stack.uris.get(how, stack.uris["qv4"]), stack.digests.get(how, "sha256:" + "0" * 64)
    if how == "rank":
        uri, digest = stack.uris["mlp16"], stack.digests["mlp16"]  # rank 16 on a base capped at 8
    if how == "no-golden":
        digest = stack.digests["qv4"]  # a valid adapter, but nothing to replay for the gate it asks for
    if how == "weights-only":  # the earlier form, refused unless the base sets requireAdapterDigest: false
        uri, digest = stack.uris["qv4"], stack.weights_digests["qv4"]
    name = f"bad-{how}"
    stack.apply(lora(name, uri, digest, **spec))
    status = stack.wait_phase(name, "Failed")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", reason), ready
    assert all(stack.on_replica(url, name) is None for url in stack.replicas.values())  # never registered
    stack.wait_phase("support", "Ready")  # the good one is untouched


def test_an_adapter_as_large_as_a_disk_fails_at_its_cap_while_a_neighbour_becomes_ready(
    stack: Stack, tiny_adapters: dict[str, Path]
) -> None:
    """A 100 GiB weights file (sparse: it costs this disk nothing) is refused from its size before a
    byte of it is copied to the operator's scratch, and a neighbour applied beside it is Ready in
    its usual time."""
    huge = shutil.copytree(tiny_adapters["qv4"], stack.folder / "huge")
    with (huge / "adapter_model.safetensors").open("r+b") as fh:
        fh.truncate(100 * 2**30)
    stack.apply(lora("huge", f"file://{huge}", "sha256:" + "0" * 64))
    stack.apply(lora("beside-huge", stack.uris["all8"], stack.digests["all8"]))
    stack.wait_phase("beside-huge", "Ready", timeout=60)
    status = stack.wait_phase("huge", "Failed")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "TooLarge") and "limit of" in ready["message"], ready
    assert all(stack.on_replica(url, "huge") is None for url in stack.replicas.values())


def test_a_pin_beyond_the_replicas_free_slots_serves_unpinned_and_says_why(stack: Stack) -> None:
    """The replicas have 3 device slots and `support` is pinned: one more pin fits, a third would
    leave no slot for unpinned adapters, so the replicas refuse it and that adapter serves
    unpinned, Ready, with the reason in its Pinned condition."""
    stack.wait_phase("support", "Ready")
    stack.apply(lora("second-pin", stack.uris["ku2"], stack.digests["ku2"], pinned=True))
    assert stack.wait_phase("second-pin", "Ready")["status"]["pinned"] is True
    stack.apply(lora("third-pin", stack.uris["qv4"], stack.digests["qv4"], pinned=True))
    status = stack.wait_phase("third-pin", "Ready")["status"]
    pinned = next(c for c in status["conditions"] if c["type"] == "Pinned")
    assert (pinned["status"], pinned["reason"]) == ("False", "PinLimitReached"), pinned
    assert "max_loras - 1 = 2" in pinned["message"] and status["pinned"] is False
    for url in stack.replicas.values():
        assert not stack.on_replica(url, "third-pin")["pinned"]
        assert stack.on_replica(url, "support")["pinned"] and stack.on_replica(url, "second-pin")["pinned"]
    for name in ("second-pin", "third-pin"):
        stack.kube.delete("LoraAdapter", NS, name)
        stack.kube.wait_for("the object to go", lambda n=name: stack.kube.get("LoraAdapter", NS, n) is None, timeout=30)


def test_a_tenant_policy_on_the_base_refuses_other_tenants_and_other_sources(stack: Stack) -> None:
    """Without the webhook: the reconcile fails an adapter naming a tenant the BaseModel does not
    list, or files outside that tenant's prefix, before anything is fetched; what serves stays."""
    stack.wait_phase("support", "Ready")
    base = stack.kube.get("BaseModel", NS, "tiny")
    assert base is not None
    policy = {**base["spec"]["tenancy"], "tenants": [{"name": "acme", "sources": ["s3://adapters/acme/"]}]}

    def apply_base(tenancy: dict[str, Any]) -> None:
        manifest = {"apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny", "namespace": NS}}
        stack.apply({**manifest, "spec": {**base["spec"], "tenancy": tenancy}})

    apply_base(policy)
    try:
        stack.apply({**lora("intruder", stack.uris["qv4"], stack.digests["qv4"]), "spec": {
            **lora("intruder", stack.uris["qv4"], stack.digests["qv4"])["spec"], "tenant": "globex"}})  # fmt: skip
        stack.apply(lora("borrowed", stack.uris["drifted"], stack.digests["drifted"]))  # acme, from broken/
        for name, reason in (("intruder", "TenantNotAllowed"), ("borrowed", "SourceNotAllowed")):
            status = stack.wait_phase(name, "Failed")["status"]
            ready = next(c for c in status["conditions"] if c["type"] == "Ready")
            assert ready["reason"] == reason, ready
            assert all(stack.on_replica(url, name) is None for url in stack.replicas.values())
        assert stack.adapter("support")["status"]["phase"] == "Ready"
    finally:
        apply_base({k: v for k, v in policy.items() if k != "tenants"})
        for name in ("intruder", "borrowed"):
            stack.kube.delete("LoraAdapter", NS, name)
            stack.kube.wait_for("the object to go", lambda n=name: stack.kube.get("LoraAdapter", NS, n) is None, timeout=30)


def test_a_second_adapter_claiming_a_served_name_waits_and_the_first_keeps_it(stack: Stack) -> None:
    """Without the webhook, a LoraAdapter naming `support`'s served name must not replace what
    the replicas serve under it: it waits (Pending, ServedNameTaken), and the name keeps serving
    the first adapter's version; once the claimant takes another name it serves under that."""
    ready = stack.wait_phase("support", "Ready")
    digest = ready["status"]["servingDigest"]
    stack.apply(lora("impostor", stack.uris["ku2"], stack.digests["ku2"], servedName="support"))

    def waiting() -> dict[str, Any] | None:
        conditions = stack.adapter("impostor").get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Ready" and c["reason"] == "ServedNameTaken"), None)

    condition = stack.kube.wait_for("the claimant to wait", waiting, timeout=30)
    assert "served by LoraAdapter 'support'" in condition["message"]
    assert stack.adapter("impostor")["status"]["phase"] == "Pending"
    assert all(stack.on_replica(url, "support")["digest"] == digest for url in stack.replicas.values())
    stack.apply(lora("waiter", stack.uris["ku2"], stack.digests["ku2"], servedName="support"))
    stack.kube.wait_for("the second claimant to wait", lambda: stack.adapter("waiter").get("status", {}).get("phase"), 30)
    stack.kube.delete("LoraAdapter", NS, "waiter")  # deleting a claimant leaves the holder serving
    stack.kube.wait_for("the object to go", lambda: stack.kube.get("LoraAdapter", NS, "waiter") is None, timeout=30)
    assert all(stack.on_replica(url, "support")["digest"] == digest for url in stack.replicas.values())
    stack.apply(lora("impostor", stack.uris["ku2"], stack.digests["ku2"], servedName="impostor-own"))
    stack.wait_phase("impostor", "Ready")
    assert all(stack.on_replica(url, "impostor-own") is not None for url in stack.replicas.values())
    stack.kube.delete("LoraAdapter", NS, "impostor")
    stack.kube.wait_for("the object to go", lambda: stack.kube.get("LoraAdapter", NS, "impostor") is None, timeout=30)


def test_a_deleted_adapter_leaves_every_replica_before_its_finalizer_goes(stack: Stack) -> None:
    stack.apply(lora("temporary", stack.uris["all8"], stack.digests["all8"]))
    stack.wait_phase("temporary", "Ready")
    assert all(stack.on_replica(url, "temporary") for url in stack.replicas.values())
    stack.kube.delete("LoraAdapter", NS, "temporary")
    stack.kube.wait_for("the object to go", lambda: stack.kube.get("LoraAdapter", NS, "temporary") is None, timeout=30)
    assert all(stack.on_replica(url, "temporary") is None for url in stack.replicas.values())


def test_a_name_no_adapter_claims_leaves_the_replicas_and_a_rename_leaves_no_old_name(stack: Stack) -> None:
    """What a replica missed while it was down: a delete (here, a registration nobody made
    through a LoraAdapter stands in for it) and a servedName change."""
    url = stack.replicas["tiny-serving-1"]
    r = httpx.post(f"{url}/admin/adapters", headers={"Authorization": f"Bearer {ADMIN}"},
                   json={"lora_name": "left-behind", "lora_path": stack.uris["ku2"]})  # fmt: skip
    assert r.status_code == 200, r.text
    stack.kube.wait_for("the unclaimed name to go", lambda: stack.on_replica(url, "left-behind") is None, timeout=20)

    stack.apply(lora("renamed", stack.uris["qv4"], stack.digests["qv4"], servedName="old-name"))
    stack.wait_phase("renamed", "Ready")
    stack.apply(lora("renamed", stack.uris["qv4"], stack.digests["qv4"], servedName="new-name"))

    def moved() -> bool:
        on = [(stack.on_replica(u, "old-name"), stack.on_replica(u, "new-name")) for u in stack.replicas.values()]
        return all(old is None and new is not None for old, new in on)

    stack.kube.wait_for("the old name to leave every replica", moved, timeout=30)
    stack.kube.delete("LoraAdapter", NS, "renamed")


def test_a_replicas_lasting_refusal_fails_the_adapter_once_and_leaves_no_replica_serving_it(stack: Stack) -> None:
    """A 400 from a replica is its answer however often it is asked: the adapter ends Failed
    with the replica's reason instead of retrying every few seconds, and a replica that took it
    gives it back."""
    engine = stack.engines["tiny-serving-0"]
    real, asked = engine.register_lora, []

    def refusing(spec: Any) -> None:
        if spec.name == "refused-here":
            asked.append(spec.digest)
            raise AdapterValidationError(ErrorCode.BAD_CONFIG, "this replica will never take it")
        real(spec)

    engine.register_lora = refusing
    try:
        stack.apply(lora("refused-here", stack.uris["qv4"], stack.digests["qv4"]))
        status = stack.wait_phase("refused-here", "Failed")["status"]
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "ReplicaRefused" and "this replica will never take it" in ready["message"], ready
        calls = len(asked)
        time.sleep(3)  # three retry delays of this stack: a retry loop would have asked again
        assert len(asked) == calls == 1
        assert all(stack.on_replica(url, "refused-here") is None for url in stack.replicas.values())
    finally:
        engine.register_lora = real
        stack.kube.delete("LoraAdapter", NS, "refused-here")


def test_a_served_name_replicas_would_refuse_fails_before_any_is_asked(stack: Stack) -> None:
    stack.apply(lora("dotted", stack.uris["qv4"], stack.digests["qv4"], servedName="two..dots"))
    status = stack.wait_phase("dotted", "Failed")["status"]
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["reason"] == "UnsafeName"
    assert all(stack.on_replica(url, "two..dots") is None for url in stack.replicas.values())
    stack.kube.delete("LoraAdapter", NS, "dotted")


def test_a_new_replica_learns_every_ready_adapter(stack: Stack) -> None:
    stack.wait_phase("support", "Ready")
    url = stack.start_replica("tiny-serving-2")

    def staged() -> dict[str, Any] | None:  # registered, then pinned: two calls, so wait for both
        state = stack.on_replica(url, "support")
        return state if state and state["pinned"] else None

    state = stack.kube.wait_for("the new replica to hold support, pinned", staged, timeout=20)
    assert state["tenant"] == "acme" and state["digest"] == stack.digests["qv4"]

    def gate_open() -> bool:  # only now may the pod join the Service and count for a rollout
        pod = stack.kube.get("Pod", NS, "tiny-serving-2") or {}
        return any(c["type"] == STAGED_CONDITION and c["status"] == "True" for c in pod["status"]["conditions"])

    stack.kube.wait_for("the new pod's readiness gate to open", gate_open, timeout=30)


def test_promotion_switches_versions_and_a_bad_version_leaves_the_old_one_serving(stack: Stack) -> None:
    """Traffic keeps flowing through the promotion and not one request fails."""
    stack.wait_phase("support", "Ready")
    client = openai.OpenAI(base_url=f"{stack.replicas['tiny-serving-0']}/v1", api_key="none", max_retries=0)
    failures: list[str] = []
    sent = 0
    stop = threading.Event()

    def traffic() -> None:
        nonlocal sent
        while not stop.is_set():
            try:
                client.completions.create(model="support", prompt="steady", max_tokens=8, extra_body={"ignore_eos": True})
            except openai.APIError as err:
                failures.append(str(err))
            sent += 1

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    stack.apply(lora("support", stack.uris["all8"], stack.digests["all8"], pinned=True))

    def promoted() -> dict[str, Any] | None:
        status = stack.adapter("support").get("status", {})
        return status if status.get("servingDigest") == stack.digests["all8"] else None

    try:
        status = stack.kube.wait_for("promotion to all8 under traffic", promoted, timeout=30)
        time.sleep(1)  # requests on the new version too
    finally:
        stop.set()
        sender.join(timeout=30)
    assert failures == [] and sent > 5
    assert next(c for c in status["conditions"] if c["type"] == "Promoted")["status"] == "True"
    assert all(stack.on_replica(url, "support")["digest"] == stack.digests["all8"] for url in stack.replicas.values())

    stack.apply(lora("support", stack.uris["all8"], "sha256:" + "1" * 64, pinned=True))

    def refused() -> dict[str, Any] | None:
        status = stack.adapter("support").get("status", {})
        promo = next((c for c in status.get("conditions", []) if c["type"] == "Promoted"), None)
        return status if promo and promo["status"] == "False" else None

    status = stack.kube.wait_for("the bad version to be refused", refused, timeout=30)
    promo = next(c for c in status["conditions"] if c["type"] == "Promoted")
    assert promo["reason"] == "DigestMismatch" and status["phase"] == "Ready"
    assert status["servingDigest"] == stack.digests["all8"]
    assert all(stack.on_replica(url, "support")["digest"] == stack.digests["all8"] for url in stack.replicas.values())


@contextmanager
def registration_held(stack: Stack, replica: str, served: str, digest: str) -> Iterator[threading.Event]:
    """The operator's registration of version ``digest`` of ``served`` on ``replica`` hangs until
    the block ends: a reconcile caught half way, after validation, registered on some replicas and
    not this one. Yields the event set once the call has arrived. (Only that version: a restarted
    operator's resume handlers re-register the serving version at any moment.)"""
    engine = stack.engines[replica]
    real, entered, release = engine.register_lora, threading.Event(), threading.Event()

    def held(spec: Any) -> None:
        if spec.name == served and spec.digest == digest:
            entered.set()
            release.wait(60)
        real(spec)

    engine.register_lora = held
    try:
        yield entered
    finally:
        release.set()
        engine.register_lora = real


def test_an_operator_killed_in_the_middle_of_a_reconcile_finishes_it_after_restarting(stack: Stack) -> None:
    with registration_held(stack, "tiny-serving-1", "midway", stack.digests["ku2"]) as entered:
        stack.apply(lora("midway", stack.uris["ku2"], stack.digests["ku2"]))
        assert entered.wait(60), stack.log()
        stack.stop_operator(signal.SIGKILL)
    stack.start_operator()
    status = stack.wait_phase("midway", "Ready")["status"]
    assert sorted(r["replica"] for r in status["replicas"]) == sorted(stack.replicas)
    assert all(stack.on_replica(url, "midway")["digest"] == stack.digests["ku2"] for url in stack.replicas.values())


def test_the_operator_converges_across_an_api_server_restart(stack: Stack) -> None:
    """The API server goes away in the middle of a reconcile and comes back on the same etcd (a
    control-plane upgrade): the operator's watches reconnect and it finishes, and it notices an
    adapter created while it was reconnecting."""
    with registration_held(stack, "tiny-serving-1", "restarted", stack.digests["ku2"]) as entered:
        stack.apply(lora("restarted", stack.uris["ku2"], stack.digests["ku2"]))
        assert entered.wait(60), stack.log()
        stack.kube.plane.stop_apiserver()
    stack.kube.plane.start_apiserver()
    stack.apply(lora("after-restart", stack.uris["qv4"], stack.digests["qv4"]))
    for name in ("restarted", "after-restart"):
        status = stack.wait_phase(name, "Ready", timeout=120)["status"]
        assert sorted(r["replica"] for r in status["replicas"]) == sorted(stack.replicas)
    assert stack.operator is not None and stack.operator.poll() is None


OUTAGE_SECONDS = 60.0  # "unreachable for a minute": the fault suite's outage


@dataclass
class Traffic:
    """Completions for one served adapter on every replica, one after another, all through an
    outage: what a user of the adapters already serving sees."""

    answered: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


@contextmanager
def steady_traffic(stack: Stack, served: str) -> Iterator[Traffic]:
    traffic = Traffic()
    clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30) for url in stack.replicas.values()]

    def run() -> None:
        while not traffic.stop.is_set():
            for client in clients:
                try:
                    client.completions.create(model=served, prompt="hi", max_tokens=4, extra_body={"ignore_eos": True})
                    traffic.answered += 1
                except openai.APIError as err:
                    traffic.failures.append(repr(err))
            traffic.stop.wait(0.2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield traffic
    finally:
        traffic.stop.set()
        thread.join(60)


def test_a_minute_without_the_object_store_delays_a_new_adapter_and_fails_nothing(stack: Stack) -> None:
    """The object store refuses every connection for a minute (its pods restarting; its Service
    without endpoints). What is served keeps serving from the replicas' own tiers; an adapter
    applied meanwhile says it waits for the store (Validated False, StoreUnreachable, retried),
    is never Failed, and becomes Ready on its own once the store is back."""
    stack.apply(lora("steady", stack.uris["ku2"], stack.digests["ku2"]))
    stack.wait_phase("steady", "Ready")
    with steady_traffic(stack, "steady") as traffic:
        stack.store.down()
        try:
            end = time.monotonic() + OUTAGE_SECONDS
            stack.apply(lora("while-the-store-is-away", stack.uris["qv4"], stack.digests["qv4"]))
            reasons: set[str] = set()
            while time.monotonic() < end:
                status = stack.adapter("while-the-store-is-away").get("status", {})
                assert status.get("phase") != "Failed", status
                reasons |= {c["reason"] for c in status.get("conditions", []) if c["type"] == "Validated"}
                time.sleep(1)
        finally:
            stack.store.up()
        status = stack.wait_phase("while-the-store-is-away", "Ready", timeout=60)["status"]
    assert "StoreUnreachable" in reasons, (reasons, stack.log())
    assert sorted(r["replica"] for r in status["replicas"]) == sorted(stack.replicas)
    assert traffic.failures == [] and traffic.answered >= 20, (traffic.answered, traffic.failures[:3])


def test_a_minute_without_the_api_server_stops_no_traffic_and_loses_no_accepted_adapter(stack: Stack) -> None:
    """The API server is gone for a minute (a control-plane outage). The replicas serve on, since
    nothing on the request path asks the API server; a write during the outage is refused to its
    writer (so it was never accepted); an adapter accepted just before it becomes Ready after it,
    and the operator process rides it out rather than exiting. Where the outage catches the
    reconcile's writes, kopf's own retry finishes it, or, where kopf lost the outcome too, the
    operator's resync does (``tests/operator/test_resync.py``). (Not held at a registration, as
    the restart test is: a held registration holds the replica's engine, and the traffic.)"""
    stack.apply(lora("steady", stack.uris["ku2"], stack.digests["ku2"]))
    stack.wait_phase("steady", "Ready")
    with steady_traffic(stack, "steady") as traffic:
        stack.apply(lora("accepted-before-the-outage", stack.uris["qv4"], stack.digests["qv4"]))
        stack.kube.plane.stop_apiserver()
        try:
            end = time.monotonic() + OUTAGE_SECONDS
            with pytest.raises(httpx.TransportError):
                stack.apply(lora("refused-during-the-outage", stack.uris["qv4"], stack.digests["qv4"]))
            time.sleep(max(0.0, end - time.monotonic()))
        finally:
            stack.kube.plane.start_apiserver()
        stack.wait_phase("accepted-before-the-outage", "Ready", timeout=120)
    assert stack.kube.get("LoraAdapter", NS, "refused-during-the-outage") is None
    assert stack.operator is not None and stack.operator.poll() is None, stack.log()
    assert traffic.failures == [] and traffic.answered >= 20, (traffic.answered, traffic.failures[:3])
    stack.kube.delete("LoraAdapter", NS, "steady")


def test_a_writer_racing_the_operator_gets_a_conflict_and_rolls_back_nothing(stack: Stack) -> None:
    """A GitOps controller's read-modify-write (GET, then PUT with that resourceVersion) that
    races the operator's status write: the server answers 409, the writer reads again and its
    change lands, the status the operator wrote survives the stale body the writer sent (status
    is a subresource), and the operator reconciles the new generation. kopf's own writes are merge
    patches without a resourceVersion, so the conflict always falls on the other writer."""
    url = f"/apis/loraplane.dev/v1alpha1/namespaces/{NS}/loraadapters/contended"
    with registration_held(stack, "tiny-serving-0", "contended", stack.digests["qv4"]) as entered:
        stack.apply(lora("contended", stack.uris["qv4"], stack.digests["qv4"]))
        assert entered.wait(60), stack.log()
        stale = stack.adapter("contended")  # read while the operator is half way, before its status write
    status = stack.wait_phase("contended", "Ready")["status"]
    stale["metadata"].setdefault("labels", {})["team"] = "support"
    stale["spec"]["prefetch"] = False
    r = stack.kube.http.put(url, json=stale)
    assert r.status_code == 409 and r.json()["reason"] == "Conflict", r.text
    fresh = stack.adapter("contended")
    fresh["metadata"].setdefault("labels", {})["team"] = "support"
    fresh["spec"]["prefetch"] = False
    fresh["status"] = {"phase": "Pending"}  # a writer's stale status in the body: ignored on the main resource
    assert stack.kube.http.put(url, json=fresh).status_code == 200

    def reconciled() -> dict[str, Any] | None:
        obj = stack.adapter("contended")
        return obj if obj["status"].get("observedGeneration") == obj["metadata"]["generation"] else None

    obj = stack.kube.wait_for("the new generation reconciled", reconciled, timeout=30)
    assert obj["metadata"]["labels"]["team"] == "support"
    assert obj["status"]["phase"] == "Ready" and obj["status"]["servingDigest"] == status["servingDigest"]
    stack.kube.delete("LoraAdapter", NS, "contended")


def test_a_promotion_in_progress_shows_both_versions_in_status(stack: Stack) -> None:
    stack.wait_phase("midway", "Ready")
    with registration_held(stack, "tiny-serving-0", "midway", stack.digests["qv4"]) as entered:
        stack.apply(lora("midway", stack.uris["qv4"], stack.digests["qv4"]))
        assert entered.wait(60), stack.log()
        status = stack.adapter("midway")["status"]
        assert (status["servingDigest"], status["promotingDigest"]) == (stack.digests["ku2"], stack.digests["qv4"])

    def promoted() -> dict[str, Any] | None:
        s = stack.adapter("midway")["status"]
        return s if s.get("servingDigest") == stack.digests["qv4"] and "promotingDigest" not in s else None

    stack.kube.wait_for("the promotion to finish", promoted, timeout=30)


def test_an_operator_restart_loses_nothing(stack: Stack) -> None:
    stack.stop_operator(signal.SIGKILL)  # no graceful shutdown: as if its node died
    stack.apply(lora("late", stack.uris["ku2"], stack.digests["ku2"]))
    stack.start_operator()
    stack.wait_phase("late", "Ready")
    stack.wait_phase("support", "Ready")


def test_auto_pinning_follows_the_traffic(stack: Stack) -> None:
    stack.wait_phase("late", "Ready")
    base = stack.kube.get("BaseModel", NS, "tiny")
    assert base is not None
    spec = {**base["spec"], "autoPinning": {"enabled": True, "hotSetSize": 2, "hysteresis": 0.2}}
    stack.apply(
        {"apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny", "namespace": NS}, "spec": spec}
    )
    client = openai.OpenAI(base_url=f"{stack.replicas['tiny-serving-0']}/v1", api_key="none", max_retries=0)

    def pinned_while_busy() -> bool:
        client.completions.create(model="late", prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
        return bool(stack.adapter("late").get("status", {}).get("pinned"))

    stack.kube.wait_for("traffic to pin 'late'", pinned_while_busy, timeout=30)
    assert stack.on_replica(stack.replicas["tiny-serving-0"], "late")["pinned"]
    stack.kube.wait_for(
        "idleness to unpin it", lambda: stack.adapter("late").get("status", {}).get("pinned") is False, timeout=30
    )
    assert stack.adapter("support")["status"]["pinned"]  # pinned by its manifest: never auto-unpinned


def test_a_dominant_adapter_is_recommended_for_a_dedicated_deployment_and_returns_when_traffic_falls(stack: Stack) -> None:
    """``dedicated.mode: recommend`` on the real operator: traffic to one adapter of the base makes
    it dominant after the hold (condition, Event, the printer column), and its end returns it after
    the return hold; turning the policy off removes the condition."""
    stack.apply(lora("busy", stack.uris["qv4"], stack.digests["qv4"]))
    stack.wait_phase("busy", "Ready")
    base = stack.kube.get("BaseModel", NS, "tiny")
    assert base is not None

    def policy(mode: str) -> None:
        set_dedicated(stack, base, mode=mode, returnSeconds=2)

    def now_shown(status: str) -> dict[str, Any] | None:
        condition = dedicated_condition(stack, "busy")
        return condition if condition and condition["status"] == status else None

    def events(reason: str) -> list[dict[str, Any]]:
        found = stack.kube.list("Event", NS, fieldSelector="involvedObject.name=busy")
        return [e for e in found if e["reason"] == reason]

    policy("recommend")
    try:
        with steady_traffic(stack, "busy") as traffic:
            dominant = stack.kube.wait_for("'busy' to be recommended", lambda: now_shown("True"), timeout=60)
            assert dominant["reason"] == "Dominant"
            assert "a merged dedicated deployment of 1 of the base's 2 replicas" in dominant["message"]
            (event,) = stack.kube.wait_for("its Event", lambda: events("Dominant"), timeout=20)
            assert event["type"] == "Normal" and "% of the base's requests" in event["message"]
            header, row = stack.kube.kubectl("-n", NS, "get", "loraadapter", "busy", "-o", "wide").stdout.splitlines()
            assert header.split()[-2:] == ["DEDICATED", "SERVED"] and row.split()[-1] == "Dominant"  # none served dedicated
            assert dedicated_condition(stack, "support") is None  # the others carry nothing
            stack.kube.wait_for(
                "the base to list it",
                lambda: stack.kube.get("BaseModel", NS, "tiny")["status"].get("dominantAdapters") == ["busy"],
            )
        assert traffic.failures == []
        back = stack.kube.wait_for("'busy' to return to shared", lambda: now_shown("False"), timeout=60)
        assert back["reason"] == "NoLongerDominant"
        stack.kube.wait_for("its Event", lambda: events("NoLongerDominant"), timeout=20)
        policy("off")
        stack.kube.wait_for("the condition removed", lambda: dedicated_condition(stack, "busy") is None, timeout=30)
        stack.kube.wait_for(
            "the base's list removed", lambda: "dominantAdapters" not in stack.kube.get("BaseModel", NS, "tiny")["status"]
        )
    finally:
        policy("off")
        stack.kube.delete("LoraAdapter", NS, "busy")


def test_auto_carves_a_merged_deployment_from_the_pool_and_gives_it_back(stack: Stack) -> None:
    """``dedicated.mode: auto`` on the real API server (no kubelet here; tests/cluster runs the
    pods): a dominant adapter gets its merged Deployment, engine ConfigMap and Service, owned by
    the LoraAdapter and merging the version the pool serves, and the shared Deployment gives up
    as many replicas. A dedicated replica (started here from that config, as the kubelet would)
    is never staged on, and its requests are the adapter's: with all its traffic there, the adapter
    stays dominant. When the traffic ends it returns: its objects go, the pool is whole again."""
    stack.apply(lora("hot", stack.uris["all8"], stack.digests["all8"]))
    stack.wait_phase("hot", "Ready")
    base = stack.kube.get("BaseModel", NS, "tiny")
    assert base is not None

    def policy(mode: str) -> None:
        set_dedicated(stack, base, mode=mode, returnSeconds=6, maxReplicas=1)

    def shared_replicas() -> int:
        return stack.kube.get("Deployment", NS, "tiny-serving")["spec"]["replicas"]  # type: ignore[index,no-any-return]

    def status() -> dict[str, Any]:
        return stack.adapter("hot").get("status", {})

    policy("auto")
    replica = ExitStack()
    try:
        with steady_traffic(stack, "hot") as traffic:
            deployment = stack.kube.wait_for(
                "its dedicated Deployment", lambda: stack.kube.get("Deployment", NS, "hot-dedicated"), timeout=60
            )
            (owner,) = deployment["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["controller"]) == ("LoraAdapter", "hot", True)
            assert deployment["spec"]["replicas"] == 1
            stack.kube.wait_for("the pool to give a replica up", lambda: shared_replicas() == 1, timeout=30)
            config_map = stack.kube.get("ConfigMap", NS, "hot-dedicated-engine")
            assert config_map is not None and stack.kube.get("Service", NS, "hot-dedicated") is not None
            config = EngineConfig.model_validate(yaml.safe_load(config_map["data"]["engine.yaml"]))
            assert (config.merged_lora, config.merged_lora_digest, config.served_model_name, config.merged_lora_tenant) == (
                stack.uris["all8"], stack.digests["all8"], "hot", "acme",
            )  # fmt: skip
            stack.kube.wait_for(
                "its status to say so",
                lambda: (status().get("servedFrom"), status().get("dedicatedReplicas")) == ("shared", 1),  # none ready yet
            )
            # The BaseModel's status is written at the end of the sync that wrote the adapter's.
            stack.kube.wait_for(
                "the base's status to count it",
                lambda: stack.kube.get("BaseModel", NS, "tiny")["status"].get("dedicatedReplicas") == 1,  # type: ignore[index]
            )
        assert traffic.failures == []

        # The dedicated replica, as the kubelet would run it from that config, and Ready.
        def make():  # type: ignore[no-untyped-def]
            return tiny_engine(
                stack.tiny_llama, stack.folder / "cache-hot-dedicated", max_loras=3, max_lora_rank=8,
                s3_endpoint=stack.endpoint, s3_access_key=ACCESS, s3_secret_key=SECRET, s3_region="us-east-1",
                merged_lora=config.merged_lora, merged_lora_digest=config.merged_lora_digest,
                merged_lora_tenant=config.merged_lora_tenant, served_model_name=config.served_model_name,
            )  # fmt: skip

        url = replica.enter_context(serve_app(create_app(make, admin_token=ADMIN)))
        pod = serving_pod("hot-dedicated-0", NS, "tiny", url)
        pod["metadata"]["labels"][DEDICATED_LABEL] = "hot"
        del pod["spec"]["readinessGates"]
        pod["status"]["conditions"] = [{"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": "True"}]
        stack.apply(pod)
        stack.kube.merge_patch("Deployment", NS, "hot-dedicated", {"status": {"replicas": 1, "readyReplicas": 1}}, "status")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 12  # twice the return hold, all of it on the dedicated replica
        while time.monotonic() < deadline:
            client.completions.create(model="hot", prompt="hi", max_tokens=4, extra_body={"ignore_eos": True})
            time.sleep(0.1)
        assert dedicated_condition(stack, "hot")["status"] == "True"  # type: ignore[index]
        stack.kube.wait_for(
            "it to be served dedicated",
            lambda: (status().get("servedFrom"), status().get("dedicatedReadyReplicas")) == ("dedicated", 1),
        )
        answer = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert list(answer["adapters"]) == ["hot"]  # its own model: the operator staged nothing on it

        stack.kube.delete("Pod", NS, "hot-dedicated-0")
        # The three go in one sync, the Deployment first (its pods end before their config does).
        stack.kube.wait_for(
            "its objects to go",
            lambda: all(stack.kube.get(kind, NS, name) is None for kind, name in
                        [("Deployment", "hot-dedicated"), ("ConfigMap", "hot-dedicated-engine"), ("Service", "hot-dedicated")]),
            timeout=60,
        )  # fmt: skip
        stack.kube.wait_for("the pool to be whole", lambda: shared_replicas() == 2, timeout=30)
        stack.kube.wait_for(
            "its status to say so", lambda: (status().get("servedFrom"), status().get("dedicatedReplicas")) == ("shared", None)
        )
    finally:
        replica.close()
        policy("off")
        stack.kube.delete("LoraAdapter", NS, "hot")


def set_dedicated(stack: Stack, base: dict[str, Any], **policy: Any) -> None:
    """The base as it was, with a dedicated policy quick enough for a test: dominant after 2 s at
    60% of the requests, back below 30%."""
    dedicated = {"share": 0.6, "holdSeconds": 2, "returnShare": 0.3, "minRequestsPerSecond": 0.5, **policy}
    stack.apply({"apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny", "namespace": NS},
                 "spec": {**base["spec"], "dedicated": dedicated}})  # fmt: skip


def dedicated_condition(stack: Stack, name: str) -> dict[str, Any] | None:
    conditions = stack.adapter(name).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "DedicatedRecommended"), None)


def test_a_fleet_settles_in_bounded_time_with_bounded_writes(stack: Stack) -> None:
    """LORAPLANE_FLEET adapters (default 40, to keep CI short; see docs/benchmarks.md for 2,000)
    created at once: time to all Ready, the operator's API writes per adapter while settling (from
    the API server's audit log), its writes while the fleet then sits idle, and the API server's
    request rate."""
    n = int(os.environ.get("LORAPLANE_FLEET", "40"))
    manifests = [lora(f"fleet-{i:04d}", stack.uris["ku2"], stack.digests["ku2"], prefetch=False) for i in range(n)]
    operator = stack.kube.operator_user
    before, requests, start = stack.kube.writes(by=operator), stack.kube.requests(), time.monotonic()
    for manifest in manifests:
        stack.kube.apply(manifest)

    def settled() -> bool:
        items = stack.kube.http.get(f"/apis/loraplane.dev/v1alpha1/namespaces/{NS}/loraadapters").json()["items"]
        return (
            sum(1 for o in items if o["metadata"]["name"].startswith("fleet-") and o.get("status", {}).get("phase") == "Ready")
            == n
        )

    stack.kube.wait_for(f"{n} adapters Ready", settled, timeout=max(120, n * 2.0))
    seconds = time.monotonic() - start

    def quiet() -> bool:  # the Events of the last transitions land just after the statuses
        count = stack.kube.writes(by=operator)
        time.sleep(1.5)
        return stack.kube.writes(by=operator) == count

    # The last status and Event writes trail the last Ready: about 70 s for 2,000 adapters.
    stack.kube.wait_for("the writes to stop", quiet, timeout=max(60, n / 10))
    settle_writes = stack.kube.writes(by=operator) - before
    rate = (stack.kube.requests() - requests) / (time.monotonic() - start)
    time.sleep(5)  # five syncs of an idle fleet
    idle_writes = stack.kube.writes(by=operator) - before - settle_writes
    per = settle_writes / n
    print(f"\n{n} adapters: Ready in {seconds:.1f} s, quiet after {time.monotonic() - start - 5:.1f} s, {per:.1f} operator"
          f" writes each, {idle_writes} writes in 5 idle seconds, {rate:.1f} API server requests/s while settling")  # fmt: skip
    assert seconds < 30 + 2 * n
    assert settle_writes <= 12 * n  # finalizer, progress, status, a few Events, one metrics write
    assert idle_writes <= 5, stack.kube.write_log()[-idle_writes:]  # the BaseModel's status, if something changed
