"""examples/fleet-500-8b: the generated LoraAdapters are exactly what generate.py writes, follow the
planner's table, and would be admitted; the BaseModel is sized as `loraplane plan` recommends and
the operator can build its serving objects."""

from __future__ import annotations

import datetime as dt
import importlib.util
import re
import sys
from functools import cache
from types import ModuleType
from typing import Any

import yaml
from crd_schema import ROOT, validator

from loraplane.operator.api import BaseModelResource, LoraAdapterResource
from loraplane.operator.children.base_model import children, engine_config
from loraplane.operator.runtime.admission import review_adapter
from loraplane.serving.config import EngineConfig
from loraplane.sim.plan_input import load_plan_input
from loraplane.sim.planner import make_plan

FLEET = ROOT / "examples" / "fleet-500-8b"
PLAN = ROOT / "examples" / "plan-500-finetunes-8b" / "plan.yaml"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_generate", FLEET / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@cache
def base() -> dict[str, Any]:
    return yaml.safe_load((FLEET / "basemodel.yaml").read_text())


@cache
def adapters() -> list[dict[str, Any]]:
    return list(yaml.load_all((FLEET / "loraadapters.yaml").read_text(), Loader=yaml.CSafeLoader))


def fine_tunes() -> list[dict[str, Any]]:
    plan = load_plan_input(PLAN)
    return [f.model_dump() for f in plan.fine_tunes()]


def test_the_committed_fleet_is_what_the_generator_writes() -> None:
    gen = generator()
    assert (FLEET / "loraadapters.yaml").read_text() == gen.render(), "run python examples/fleet-500-8b/generate.py"
    assert gen.main(["--check"]) == 0


def test_every_fine_tune_of_the_plan_is_an_adapter_with_its_rank_in_a_plausible_tenant() -> None:
    docs = adapters()
    assert [(d["metadata"]["name"], d["spec"]["rank"]) for d in docs] == [(f["name"], f["rank"]) for f in fine_tunes()]
    tenants = [d["spec"]["tenant"] for d in docs]
    sizes = sorted((tenants.count(t) for t in set(tenants)), reverse=True)
    assert len(sizes) == 40 and sizes[-1] >= 1 and sizes[0] <= 100, sizes  # skewed, not one tenant owning all
    assert {d["metadata"]["namespace"] for d in docs} == {base()["metadata"]["namespace"]}
    assert {d["spec"]["baseModel"] for d in docs} == {base()["metadata"]["name"]}
    for d in docs:
        name, tenant, source = d["metadata"]["name"], d["spec"]["tenant"], d["spec"]["source"]
        match = re.fullmatch(rf"s3://adapters/{tenant}/{name}/(\d{{4}}-\d{{2}}-\d{{2}})/", source["uri"])
        assert match is not None, source["uri"]
        dt.date.fromisoformat(match.group(1))
    assert len({d["spec"]["source"]["digest"] for d in docs}) == len(docs)


def test_every_adapter_validates_and_would_pass_the_admission_webhook() -> None:
    schema = validator("LoraAdapter")
    base_spec = BaseModelResource.model_validate(base()).spec.body()
    cap = base()["spec"]["engine"]["maxLoraRank"]
    for d in adapters():
        assert [e.message for e in schema.iter_errors(d)] == [], d["metadata"]["name"]
        LoraAdapterResource.model_validate(d)
        assert review_adapter(d["spec"], base_spec) == [], d["metadata"]["name"]
        assert (d["spec"].get("rankPolicy") == "Truncate") == (d["spec"]["rank"] > cap), d["metadata"]["name"]
    assert list(validator("BaseModel").iter_errors(base())) == []


def test_the_hottest_adapters_are_pinned_and_leave_slots_for_the_tail() -> None:
    by_share = sorted(fine_tunes(), key=lambda f: -f["share"])
    pinned = [d["metadata"]["name"] for d in adapters() if d["spec"].get("pinned")]
    assert pinned == [f["name"] for f in by_share[: len(pinned)]]
    assert 5 <= len(pinned) <= base()["spec"]["engine"]["maxLoras"] - base()["spec"]["autoPinning"]["headroomSlots"]
    default = base()["spec"]["tenancy"]["defaultQuotas"]
    own = {d["metadata"]["name"]: d["spec"]["quotas"] for d in adapters() if "quotas" in d["spec"]}
    assert by_share[0]["name"] in own and by_share[-1]["name"] not in own
    assert all(
        q["maxConcurrent"] >= default["maxConcurrent"] and q["tokensPerMinute"] >= default["tokensPerMinute"]
        for q in own.values()
    )


def test_the_base_is_sized_as_the_planner_recommends() -> None:
    plan_input = load_plan_input(PLAN)
    plan = make_plan(plan_input)
    assert plan.merged == []  # no adapter dominates: the whole fleet is on the shared base
    spec = base()["spec"]
    engine = spec["engine"]
    assert engine["maxLoraRank"] == plan.rank_cap
    assert engine["maxLoras"] == plan.gpu_slots
    assert engine["maxCpuLoras"] == plan.host_slots == len(adapters())
    assert engine["evictionPolicy"] == plan_input.knobs.policy
    assert engine["maxNumSeqs"] == plan_input.budget.max_num_seqs
    assert spec["replicas"] == plan.replicas
    dedicated = spec["dedicated"]
    assert dedicated["mode"] == "recommend" and dedicated["share"] == plan_input.knobs.dedicated_share


def test_the_operator_builds_gpu_serving_objects_from_the_base() -> None:
    resource = BaseModelResource.model_validate(base())
    config = EngineConfig.model_validate(engine_config(resource.spec))  # an s3:// base would raise here
    assert config.quantization == "fp8" and config.max_loras == 92 and config.eviction_policy == "tinylfu"
    built = children("llama-3-1-8b", "llm-fleet", resource.spec)
    objects = {(o["kind"], o["metadata"]["name"]): o for o in built}
    pod = objects["Deployment", "llama-3-1-8b-serving"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "tenants", "secret": {"secretName": "fleet-tenant-keys"}} in pod["volumes"]
