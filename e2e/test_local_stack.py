"""The whole stack on loopback: the real operator, two serving replicas and the router as processes,
a real Kubernetes API server (etcd and kube-apiserver, tests/helpers/envtest.py) and moto as S3.
The examples' manifests go in as `kubectl apply` would send them (the base swapped for the tiny
test model and each adapter's source for weights uploaded here, since the examples point at a real
store); traffic goes through the router with the official client."""

from __future__ import annotations

import base64
import itertools
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from envtest import Kube, control_plane, node_address, token_kubeconfig
from operator_process import start_operator
from s3_server import ACCESS, SECRET, moto_server, upload_folder
from scenario import condition, daily_promotion, example_manifests, status_of, wait_for
from serving_pods import admin_secret, serving_pod
from tiny_models import make_peft_adapter, make_tiny_llama

from loraplane.adapter_format import adapter_digest
from loraplane.serving.bench.deployment import Fleet, spawn_replicas, spawn_router
from loraplane.serving.config import EngineConfig

pytestmark = pytest.mark.slow
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Stack:
    kube: Kube
    fleet: Fleet
    router: str
    namespace: str
    adapters: dict[str, dict[str, Any]]  # name -> the manifest as applied
    versions: dict[str, tuple[str, str]] = field(default_factory=dict)  # label -> (uri, digest)

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.router}/v1", api_key=self.fleet.keys[tenant], max_retries=0)

    def on_replicas(self, served: str) -> list[dict[str, Any] | None]:
        headers = {"Authorization": f"Bearer {self.fleet.admin_token}"}
        answers = [httpx.get(f"{url}/admin/adapters/{served}", headers=headers) for url in self.fleet.urls]
        return [r.json() if r.status_code == 200 else None for r in answers]


def upload(
    endpoint: str, base: Path, folder: Path, prefix: str, rank: int, targets: list[str], seed: int, *, golden: bool = False
) -> tuple[str, str]:
    path = make_peft_adapter(base, folder, rank, 2 * rank, targets, False, seed=seed)
    if golden:  # what a training pipeline ships for the quality gate: greedy answers on its base
        record_golden(base, path, folder.parent / f"{folder.name}-cache")
    return upload_folder(endpoint, "adapters", prefix, path), adapter_digest(path)


def record_golden(base: Path, adapter: Path, cache: Path) -> None:
    from loraplane.adapter_format.digest import GOLDEN_FILE
    from loraplane.serving.engine.builder import build_engine
    from loraplane.serving.engine.sampling_params import SamplingParams

    engine = build_engine(EngineConfig(model=str(base), dtype="float32", cache_dir=cache, max_lora_rank=16,
                                    lora_modules={"candidate": str(adapter)}))  # fmt: skip
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    outs = engine.generate(prompts, params, ["candidate"] * len(prompts))
    cases = [{"prompt_token_ids": p, "greedy_token_ids": o.token_ids,
              "top_logprobs": [{str(t): lp for t, lp in step.top} for step in o.logprobs]}
             for p, o in zip(prompts, outs, strict=True)]  # fmt: skip
    (adapter / GOLDEN_FILE).write_text(json.dumps({"cases": cases}))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("e2e")
    tiny = make_tiny_llama(root / "tiny-llama", rope_scaling=None)
    base, adapters = example_manifests()
    ns, base_name = base["metadata"]["namespace"], base["metadata"]["name"]
    tenants = sorted({a["spec"]["tenant"] for a in adapters})
    with ExitStack() as stack_:
        endpoint = stack_.enter_context(moto_server())
        kube = stack_.enter_context(control_plane(root / "kube"))
        config = EngineConfig(
            model=str(tiny), dtype="float32", cache_dir=root / "cache", max_loras=2, max_cpu_loras=8, max_lora_rank=16,
            block_size=4, num_kv_blocks=256, s3_endpoint=endpoint, s3_access_key=ACCESS, s3_secret_key=SECRET,
            s3_region="us-east-1",
        )  # fmt: skip
        # Pod IPs and EndpointSlice addresses cannot be loopback on a real API server: the replicas
        # listen on this machine's own address.
        node = node_address()
        fleet = stack_.enter_context(spawn_replicas(config, {}, tenants, 2, start_timeout=180, host=node))

        # What the cluster would hold: the Secrets the manifests reference, the serving pods the
        # operator's Deployment would run (pointing at the local replicas), and the EndpointSlices
        # the endpoint controller would publish for the serving Service.
        store = {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET}
        secret_name = base["spec"]["adapterStore"]["credentialsSecret"]["name"]
        kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name, "namespace": ns},
                    "data": {k: base64.b64encode(v.encode()).decode() for k, v in store.items()}})  # fmt: skip
        kube.apply(admin_secret(ns, base_name, fleet.admin_token))
        keys = base64.b64encode((fleet.work / "tenants.yaml").read_bytes()).decode()
        kube.apply({"apiVersion": "v1", "kind": "Secret", "data": {"tenants.yaml": keys},
                    "metadata": {"name": base["spec"]["tenancy"]["apiKeysSecret"]["name"], "namespace": ns}})  # fmt: skip
        for i, url in enumerate(fleet.urls):
            pod = f"{base_name}-serving-{i}"
            kube.apply(serving_pod(pod, ns, base_name, url))
            kube.apply({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": pod, "namespace": ns, "labels": {"kubernetes.io/service-name": f"{base_name}-serving"}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": int(url.rsplit(":", 1)[1]), "protocol": "TCP"}],
                "endpoints": [{"addresses": [node], "conditions": {"ready": True},
                               "targetRef": {"kind": "Pod", "name": pod, "namespace": ns}}],
            })  # fmt: skip

        applied: dict[str, dict[str, Any]] = {}
        versions: dict[str, tuple[str, str]] = {}
        for i, manifest in enumerate(adapters):
            spec = manifest["spec"]
            rank, targets = spec.get("rank", 8), spec.get("targetModules", ["q_proj", "v_proj"])
            prefix = f"{spec['tenant']}/{manifest['metadata']['name']}/v1"
            gate = "qualityGate" in spec
            uri, digest = upload(endpoint, tiny, root / prefix, prefix, rank, targets, seed=i + 1, golden=gate)
            applied[manifest["metadata"]["name"]] = {**manifest, "spec": {**spec, "source": {"uri": uri, "digest": digest}}}
        first = adapters[0]
        name, tenant = first["metadata"]["name"], first["spec"]["tenant"]
        versions["v1"] = (applied[name]["spec"]["source"]["uri"], applied[name]["spec"]["source"]["digest"])
        rank, targets = first["spec"].get("rank", 8), first["spec"].get("targetModules", ["q_proj", "v_proj"])
        versions["v2"] = upload(endpoint, tiny, root / "v2", f"{tenant}/{name}/v2", rank, targets, seed=101)
        broken_uri, _ = upload(endpoint, tiny, root / "v3", f"{tenant}/{name}/v3", rank, targets, seed=102)
        versions["broken"] = (broken_uri, versions["v2"][1])  # the pipeline recorded the wrong digest

        stack_.enter_context(_operator(kube, fleet, root))
        kube.apply({**base, "spec": {**base["spec"], "source": {"uri": str(tiny)},
                                     "adapterStore": {**base["spec"]["adapterStore"], "endpoint": endpoint,
                                                      "region": "us-east-1"}}})  # fmt: skip
        for manifest in applied.values():
            kube.apply(manifest)
        # The router runs as the ServiceAccount the operator made for it, with only the Role the
        # operator granted it: a permission the router lacks fails its discovery here.
        account = f"{base_name}-router"
        kube.wait_for("the router's RoleBinding", lambda: kube.get("RoleBinding", ns, account), timeout=60)
        access = token_kubeconfig(kube, ns, account, root / "router.kubeconfig")
        router = stack_.enter_context(spawn_router(fleet, service=(ns, f"{base_name}-serving"), kubeconfig=access))
        yield Stack(kube, fleet, router, ns, applied, versions)


@contextmanager
def _operator(kube: Kube, fleet: Fleet, root: Path) -> Iterator[None]:
    proc = start_operator(kube.kubeconfig, root / "operator.log")
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ready(stack: Stack, name: str) -> None:
    try:
        wait_for(f"{name} Ready", lambda: status_of(stack.kube, stack.namespace, name).get("phase") == "Ready", 90)
    except AssertionError:
        raise AssertionError(f"{name}: {status_of(stack.kube, stack.namespace, name)}") from None


def test_the_examples_become_ready_on_every_replica(stack: Stack) -> None:
    for name, manifest in stack.adapters.items():
        ready(stack, name)
        served = manifest["spec"].get("servedName", name)
        held = stack.on_replicas(served)
        assert all(h is not None and h["digest"] == manifest["spec"]["source"]["digest"] for h in held), held


def test_traffic_through_the_router_reaches_each_adapters_status(stack: Stack) -> None:
    sent: dict[str, int] = {}
    for i, (name, manifest) in enumerate(stack.adapters.items()):
        ready(stack, name)
        client = stack.client(manifest["spec"]["tenant"])
        served = manifest["spec"].get("servedName", name)
        for _ in range(3 + 2 * i):  # a different count per adapter, so a mix-up shows
            out = client.completions.create(model=served, prompt="hello from e2e", max_tokens=4, extra_body={"ignore_eos": True})
            assert out.usage is not None and out.usage.completion_tokens == 4
        sent[name] = 4 * (3 + 2 * i)
    for name, tokens in sent.items():
        served = stack.adapters[name]["spec"].get("servedName", name)

        def figures(name: str = name, tokens: int = tokens) -> dict[str, Any] | None:
            m = status_of(stack.kube, stack.namespace, name).get("metrics") or {}
            return m if m.get("completionTokens") == tokens else None

        metrics = wait_for(f"{name}'s figures in status", figures, 60)
        counts = [h for h in stack.on_replicas(served) if h]
        arrivals = sum(h["device_hits"] + h["host_hits"] + h["cold_loads"] for h in counts)
        device = sum(h["device_hits"] for h in counts)
        assert arrivals == tokens // 4  # every request was counted once, on the replica that served it
        assert metrics["deviceHitRate"] == pytest.approx(device / arrivals, abs=1e-3)
        assert metrics["coldLoads"] == sum(h["cold_loads"] for h in counts)
    # Another tenant's adapter does not exist for this key, through the router as on a replica.
    names = list(stack.adapters)
    a, b = stack.adapters[names[0]], stack.adapters[names[1]]
    other = stack.client(b["spec"]["tenant"])
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model=a["spec"].get("servedName", names[0]), prompt="x", max_tokens=2)


def table(text: str) -> list[dict[str, str]]:
    """kubectl's table output as rows of header -> cell (columns are two or more spaces apart)."""
    lines = text.splitlines()
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=\s{2}))\S", lines[0])]
    cut = [*starts, None]
    return [{lines[0][a:b].strip(): line[a:b].strip() for a, b in itertools.pairwise(cut)} for line in lines[1:]]


def test_kubectl_get_prints_each_adapters_figures_after_traffic(stack: Stack) -> None:
    """The printer columns a person reads, from the real kubectl, against the stored status (read
    before and after, and again until no status write fell in between)."""

    def snapshot() -> tuple[dict[str, Any], str, dict[str, Any]] | None:
        before = {name: status_of(stack.kube, stack.namespace, name) for name in stack.adapters}
        out = stack.kube.kubectl("get", "loraadapters", "-n", stack.namespace).stdout
        after = {name: status_of(stack.kube, stack.namespace, name) for name in stack.adapters}
        return (before, out, after) if before == after else None

    statuses, out, _ = wait_for("a table between two status writes", snapshot, 30)
    rows = {r["NAME"]: r for r in table(out)}
    assert set(rows) == set(stack.adapters)
    for name, manifest in stack.adapters.items():
        status, row = statuses[name], rows[name]
        assert (row["BASE"], row["TENANT"], row["PHASE"]) == (manifest["spec"]["baseModel"], manifest["spec"]["tenant"], "Ready")
        assert int(row["RANK"]) == status["rank"] and row["PINNED"] == str(status["pinned"]).lower()
        assert float(row["HIT RATE"]) == pytest.approx(status["metrics"]["deviceHitRate"], abs=1e-6)
        assert float(row["REQ/S"]) == pytest.approx(status["metrics"]["requestsPerSecond"], abs=1e-6)
    base, _ = example_manifests()
    [row] = table(stack.kube.kubectl("get", "basemodels", "-n", stack.namespace).stdout)
    stored = stack.kube.get("BaseModel", stack.namespace, base["metadata"]["name"])
    assert stored is not None
    assert row["NAME"] == base["metadata"]["name"] and row["PHASE"] == stored["status"]["phase"]
    assert int(row["ADAPTERS"]) == stored["status"]["readyAdapters"] == len(stack.adapters)
    assert int(row["REPLICAS"]) == stored["spec"]["replicas"]


def test_the_base_models_status_rolls_up_each_tenants_usage(stack: Stack) -> None:
    base, _ = example_manifests()
    name, manifest = next(iter(stack.adapters.items()))
    ready(stack, name)
    tenant = manifest["spec"]["tenant"]
    client = stack.client(tenant)
    served = manifest["spec"].get("servedName", name)
    start = {t["tenant"]: t for t in (stack.kube.get("BaseModel", stack.namespace, base["metadata"]["name"]) or {})
             .get("status", {}).get("usage", {}).get("tenants", [])}  # fmt: skip
    before = start.get(tenant, {}).get("completionTokens", 0)
    for _ in range(3):
        client.completions.create(model=served, prompt="billed", max_tokens=5, extra_body={"ignore_eos": True})

    def rolled_up() -> dict[str, Any] | None:
        obj = stack.kube.get("BaseModel", stack.namespace, base["metadata"]["name"]) or {}
        rows = {t["tenant"]: t for t in obj.get("status", {}).get("usage", {}).get("tenants", [])}
        row = rows.get(tenant)
        return row if row is not None and row["completionTokens"] >= before + 15 else None

    row = wait_for(f"{tenant}'s usage in the BaseModel's status", rolled_up, 60)
    assert row["requests"] >= 3 and row["promptTokens"] > 0


def test_the_daily_promotion_story_fails_no_request(stack: Stack) -> None:
    name, manifest = next(iter(stack.adapters.items()))
    ready(stack, name)
    client = stack.client(manifest["spec"]["tenant"])
    traffic, refusal = daily_promotion(stack.kube, manifest, client, stack.versions)
    assert traffic.failures == [], traffic.failures[:3]
    assert traffic.sent >= 12
    assert refusal["reason"] == "DigestMismatch"
    served = manifest["spec"].get("servedName", name)
    assert all(h and h["digest"] == stack.versions["v1"][1] for h in stack.on_replicas(served))  # rolled back everywhere
    assert (condition(status_of(stack.kube, stack.namespace, name), "Ready") or {}).get("status") == "True"


def test_the_request_rate_in_status_follows_steady_traffic(stack: Stack) -> None:
    """Rates are measured between two syncs (every second here), so a few seconds of steady
    traffic must show up in status at about the rate the client sent."""
    name, manifest = list(stack.adapters.items())[-1]
    ready(stack, name)
    client = stack.client(manifest["spec"]["tenant"])
    served = manifest["spec"].get("servedName", name)
    seen: list[float] = []
    sent, start = 0, time.monotonic()
    while time.monotonic() - start < 6:
        client.completions.create(model=served, prompt="steady", max_tokens=2)
        sent += 1
        seen.append((status_of(stack.kube, stack.namespace, name).get("metrics") or {}).get("requestsPerSecond", 0.0))
    client_rate = sent / (time.monotonic() - start)
    assert 0.25 * client_rate <= max(seen) <= 3 * client_rate, (client_rate, seen)
