"""``dedicated.mode: auto``'s objects and budget, without a cluster: the dedicated deployment's
manifests are valid Kubernetes objects whose engine config the real server reads as a merged
replica of the adapter's serving version, its pods join the base's serving Service (where the
router finds them) but not the shared Deployment's count, and the replicas it takes come out of
the pool, which always keeps one."""

from __future__ import annotations

import asyncio

import kubernetes_validate
import pytest
import yaml
from crd_schema import examples

from loraplane.operator.api.basemodel import BaseModelSpec, DedicatedPolicy
from loraplane.operator.api.common import Quotas
from loraplane.operator.children.base_model import CONFIG_HASH, children
from loraplane.operator.children.dedicated import DEDICATED_LABEL, dedicated_name, dedicated_objects
from loraplane.operator.runtime import cluster, dedicated_deploy
from loraplane.operator.runtime.dedicated_deploy import DeployMemory, placements, sync_deployments
from loraplane.serving.config import EngineConfig

BASE = next(d for d in examples() if d["kind"] == "BaseModel")
SPEC = BaseModelSpec.model_validate({**BASE["spec"], "replicas": 4})
DIGEST = "sha256:" + "1" * 64


QUOTAS = Quotas(tokens_per_minute=6000)


def objects(digest: str = DIGEST, replicas: int = 2) -> dict[str, dict]:
    built = dedicated_objects(
        "smollm2", "ns", SPEC, "support-bot", "support", "s3://adapters/acme/support", digest, "acme", replicas, QUOTAS
    )
    return {m["kind"]: m for m in built}


def test_the_dedicated_objects_are_valid_and_the_server_reads_their_config_as_a_merged_replica() -> None:
    built = objects()
    for manifest in built.values():
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    config = EngineConfig.model_validate(yaml.safe_load(built["ConfigMap"]["data"]["engine.yaml"]))
    assert (config.merged_lora, config.merged_lora_digest, config.merged_lora_tenant, config.served_model_name) == (
        "s3://adapters/acme/support", DIGEST, "acme", "support",
    )  # fmt: skip
    assert config.model == "embedded"  # the base's own source, merged into at start
    assert config.max_loras == 1 and SPEC.engine.max_loras > 1  # no adapter slots beyond the engine's least
    assert config.merged_lora_quotas is not None and config.merged_lora_quotas.tokens_per_minute == 6000
    deployment = built["Deployment"]
    assert deployment["metadata"]["name"] == "support-bot-dedicated" and deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert "readinessGates" not in pod["spec"]  # nothing is staged on it
    (engine,) = [v for v in pod["spec"]["volumes"] if v["name"] == "engine"]
    assert engine["configMap"]["name"] == built["ConfigMap"]["metadata"]["name"]


def test_its_pods_join_the_base_serving_service_and_only_their_own_deployment_selects_them_by_its_label() -> None:
    shared = {f"{m['kind']}/{m['metadata']['name']}": m for m in children("smollm2", "ns", SPEC)}
    pod_labels = objects()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = shared["Service/smollm2-serving"]["spec"]["selector"]
    assert service.items() <= pod_labels.items()  # the router watches this Service's EndpointSlices
    selector = objects()["Deployment"]["spec"]["selector"]["matchLabels"]
    assert selector[DEDICATED_LABEL] == "support-bot" and selector.items() <= pod_labels.items()
    assert objects()["Service"]["spec"]["selector"] == selector


def test_a_promotion_rolls_the_dedicated_pods_and_a_resync_does_not() -> None:
    def rolled(digest: str) -> str:
        return objects(digest)["Deployment"]["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]

    assert rolled(DIGEST) == rolled(DIGEST) and rolled("sha256:" + "2" * 64) != rolled(DIGEST)


def test_the_shared_pool_gives_up_what_the_dedicated_deployments_take_and_keeps_one() -> None:
    def pool(taken: int) -> int:
        built = {f"{m['kind']}/{m['metadata']['name']}": m for m in children("smollm2", "ns", SPEC, dedicated_replicas=taken)}
        return built["Deployment/smollm2-serving"]["spec"]["replicas"]

    assert (pool(0), pool(2), pool(9)) == (4, 2, 1)


@pytest.mark.parametrize(
    ("pool", "shares", "want"),
    [
        (4, {"a": 0.5}, {"a": 2}),
        (4, {"a": 0.9}, {"a": 3}),  # the pool keeps one
        (4, {"a": 0.5, "b": 0.4}, {"a": 2, "b": 1}),  # largest share first, within what is left
        (1, {"a": 0.9}, {}),  # nothing to carve from a single replica
        (16, {"a": 0.9}, {"a": 4}),  # maxReplicas
    ],
)
def test_placements_follow_the_planners_rule_within_the_budget(pool: int, shares: dict[str, float], want: dict[str, int]) -> None:
    assert placements(DedicatedPolicy(mode="auto"), pool, shares) == want


def test_a_name_that_is_no_dns_label_gets_a_digest_for_its_objects() -> None:
    assert dedicated_name("bot") == "bot-dedicated"
    long = dedicated_name("a.b")
    assert long.startswith("lora-") and long.endswith("-dedicated") and len(long) <= 63


def test_outside_auto_one_sync_clears_what_auto_left_and_the_next_ones_call_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    left = [cluster.DedicatedDeployment("hot-dedicated", "hot", 1, 1)]

    async def listed(namespace: str, base: str, label: str) -> list[cluster.DedicatedDeployment]:
        calls.append("list")
        return list(left)

    async def deleted(namespace: str, deployment: str, service: str, config_map: str) -> None:
        calls.append(f"delete {deployment}")
        left.clear()

    async def scaled(namespace: str, name: str, replicas: int, manager: str) -> None:
        calls.append(f"scale {name} {replicas}")

    monkeypatch.setattr(dedicated_deploy.cluster, "dedicated_deployments", listed)
    monkeypatch.setattr(dedicated_deploy.cluster, "delete_children", deleted)
    monkeypatch.setattr(dedicated_deploy.cluster, "scale_deployment", scaled)
    memory = DeployMemory()
    off = BaseModelSpec.model_validate({**BASE["spec"], "replicas": 4, "dedicated": {"mode": "off"}})
    for _ in range(3):
        asyncio.run(sync_deployments("ns", "smollm2", off, [], memory))
    assert calls == ["list", "delete hot-dedicated", "scale smollm2-serving 4"]
    auto = BaseModelSpec.model_validate({**BASE["spec"], "replicas": 4, "dedicated": {"mode": "auto"}})
    asyncio.run(sync_deployments("ns", "smollm2", auto, [], memory))  # auto reads every sync
    asyncio.run(sync_deployments("ns", "smollm2", auto, [], memory))
    assert calls[3:] == ["list", "scale smollm2-serving 4"] * 2


MERGED_SPEC = BaseModelSpec.model_validate({
    **BASE["spec"], "replicas": 4,
    "resources": {**BASE["spec"].get("resources", {}), "gpus": 1, "nodeSelector": {"pool": "gpu"}},
    "nodeCache": {"enabled": True},
    "dedicated": {"mode": "auto", "mergedStore": "s3://models/merged"},
})  # fmt: skip
OWNER = {"apiVersion": "loraplane.dev/v1alpha1", "kind": "LoraAdapter",
         "metadata": {"name": "support-bot", "namespace": "ns", "uid": "u-1"}}  # fmt: skip


def test_a_merged_store_needs_the_node_cache() -> None:
    with pytest.raises(ValueError, match=r"needs nodeCache\.enabled"):
        BaseModelSpec.model_validate({**BASE["spec"], "dedicated": {"mode": "auto", "mergedStore": "s3://models/merged"}})


class FakeCluster:
    """The cluster calls of a merged store's sync, recorded; a Job's outcome as the test sets it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.jobs: dict[str, cluster.JobOutcome] = {}
        self.created: list[dict] = []
        self.applied: list[dict] = []
        self.status: list[dict] = []
        self.pool: list[int] = []
        self.deployments: list[cluster.DedicatedDeployment] = []
        c = dedicated_deploy.cluster

        async def job_outcome(namespace: str, name: str) -> cluster.JobOutcome | None:
            return self.jobs.get(name)

        async def create_job(manifest: dict) -> None:
            self.created.append(manifest)
            self.jobs[manifest["metadata"]["name"]] = cluster.JobOutcome("running")

        async def delete_jobs(namespace: str, selector: str, keep: set[str]) -> None:
            self.jobs = {k: v for k, v in self.jobs.items() if k in keep}

        async def apply_child(manifest: dict) -> None:
            self.applied.append(manifest)
            if manifest["kind"] == "Deployment":
                d = cluster.DedicatedDeployment(manifest["metadata"]["name"], "support-bot", manifest["spec"]["replicas"], 0)
                self.deployments = [d]

        async def patch_status(namespace: str, plural: str, name: str, status: dict) -> None:
            self.status.append(status)

        async def listed(namespace: str, base: str, label: str) -> list[cluster.DedicatedDeployment]:
            return list(self.deployments)

        async def scaled(namespace: str, name: str, replicas: int, manager: str) -> None:
            self.pool.append(replicas)

        async def deleted(namespace: str, deployment: str, service: str, config_map: str) -> None:
            self.deployments = [d for d in self.deployments if d.name != deployment]

        for name, fake in [("job_outcome", job_outcome), ("create_job", create_job), ("delete_jobs", delete_jobs),
                           ("apply_child", apply_child), ("patch_status", patch_status),
                           ("dedicated_deployments", listed), ("scale_deployment", scaled),
                           ("delete_children", deleted)]:  # fmt: skip
            monkeypatch.setattr(c, name, fake)


def test_with_a_merged_store_each_version_is_merged_once_by_a_job_and_served_from_the_node_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loraplane.operator.api.loraadapter import MergedModel
    from loraplane.operator.runtime.dedicated_deploy import Candidate

    fake, memory, events = FakeCluster(monkeypatch), DeployMemory(), []

    def sync(digest: str, merged: MergedModel | None) -> dict[str, int]:
        c = Candidate(OWNER, "support", 0.9, "s3://adapters/acme/support", digest, "acme", QUOTAS, merged)
        return asyncio.run(sync_deployments("ns", "smollm2", MERGED_SPEC, [c], memory, events))[1]

    # First merge: a Job, owned by the adapter; no dedicated pods and no replica taken until it is written.
    assert sync(DIGEST, None) == {} and fake.pool == [4] and not fake.applied
    (job,) = fake.created
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    assert job["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["restartPolicy"] == "Never" and "nvidia.com/gpu" not in container["resources"]["limits"]
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "merge"  # never a replica
    args = container["args"]
    uri = args[args.index("--publish") + 1]
    assert args[:4] == ["merge", "s3://adapters/acme/support", "--digest", DIGEST] and uri.startswith("s3://models/merged/ns/")
    assert sync(DIGEST, None) == {} and len(fake.created) == 1  # still running: not created twice
    # Written: its digest (the pod's termination message) into the adapter's status, and the pods serve the copy.
    written = "sha256:" + "a" * 64
    fake.jobs[job["metadata"]["name"]] = cluster.JobOutcome("succeeded", written + "\n")
    assert sync(DIGEST, None) == {"support": 3} and fake.pool[-1] == 1
    merged = MergedModel.model_validate(fake.status[-1]["mergedModel"])
    assert (merged.uri, merged.digest, merged.adapter_digest) == (uri, written, DIGEST)
    deployment = next(m for m in fake.applied if m["kind"] == "Deployment")
    (wait,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert wait["args"][-4:] == ["--source", uri, "--digest", written]
    config = EngineConfig.model_validate(
        yaml.safe_load(next(m for m in fake.applied if m["kind"] == "ConfigMap")["data"]["engine.yaml"])
    )
    assert (
        config.merged_lora is None
        and config.served_model_name == "support"
        and config.model.startswith("/var/lib/loraplane-node/bases/")
    )
    # Next syncs read the status: no Job is looked for again.
    fake.jobs.clear()
    assert sync(DIGEST, merged) == {"support": 3} and len(fake.created) == 1
    assert "LORAPLANE_ADMIN_TOKEN" not in {e["name"] for e in container["env"]}  # the Job holds no replica's token
    # A promotion: the new version merged by a new Job; meanwhile the shared pool, which serves the
    # new version, serves the adapter (never the dedicated pods' old one) and has its replicas back.
    newer = "sha256:" + "2" * 64
    assert sync(newer, merged) == {} and len(fake.created) == 2 and fake.pool[-1] == 4 and fake.deployments == []
    assert fake.created[-1]["spec"]["template"]["spec"]["containers"][0]["args"][3] == newer
    # A failed merge is said once, as a Warning, and the adapter stays on the shared pool.
    fake.jobs[fake.created[-1]["metadata"]["name"]] = cluster.JobOutcome("failed", "BackoffLimitExceeded: out of memory")
    assert sync(newer, merged) == {} and sync(newer, merged) == {}
    failed = [e for e in events if e[2] == "MergeFailed"]
    assert len(failed) == 1 and "out of memory" in failed[0][3]
