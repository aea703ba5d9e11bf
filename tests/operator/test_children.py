"""What a BaseModel creates: valid Kubernetes objects, and an engine config the real server accepts."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from crd_schema import examples

from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.children import UnsupportedSource, children
from loraplane.serving.config import EngineConfig

BASE = next(d for d in examples() if d["kind"] == "BaseModel")


def built(spec: dict | None = None) -> dict[str, dict]:
    model = BaseModelSpec.model_validate(spec or BASE["spec"])
    return {m["kind"]: m for m in children("smollm2", "loraplane-demo", model, "loraplane-admin")}


def test_every_child_is_a_valid_kubernetes_object() -> None:
    for manifest in built().values():
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_the_engine_config_is_what_the_server_reads() -> None:
    config = EngineConfig.model_validate(yaml.safe_load(built()["ConfigMap"]["data"]["engine.yaml"]))
    engine = BASE["spec"]["engine"]
    assert (config.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, config.max_num_seqs) == (
        "embedded", engine["maxLoras"], engine["maxLoraRank"], engine["maxCpuLoras"], engine["maxNumSeqs"],
    )  # fmt: skip
    assert config.s3_endpoint == BASE["spec"]["adapterStore"]["endpoint"]


def test_the_deployment_carries_secrets_by_reference_and_the_sizing() -> None:
    pod = built()["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "--tenants" in container["args"]
    assert {"secretRef": {"name": "adapter-store"}} in container["envFrom"]
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "loraplane-admin"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]  # gpus: 0 in the embedded example
    gpu = copy.deepcopy(BASE["spec"])
    gpu["resources"] = {"gpus": 2, "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
    pod = built(gpu)["Deployment"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2" and pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert built()["Service"]["spec"]["selector"] == built()["Deployment"]["spec"]["selector"]["matchLabels"]


def test_a_base_in_object_storage_is_refused_with_a_reason() -> None:
    spec = copy.deepcopy(BASE["spec"])
    spec["source"] = {"uri": "s3://models/llama-8b"}
    with pytest.raises(UnsupportedSource, match="s3://models/llama-8b"):
        built(spec)
