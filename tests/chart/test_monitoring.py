"""Monitoring: the ServiceMonitor and PrometheusRule appear only where the Prometheus Operator is,
scrape what the operator creates, and every query (alerts and dashboard) names series and label
values the code really exports."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from crd_schema import ROOT, crds
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.node_cache.agent import NodeAgent
from loraplane.node_cache.app import create_agent_app
from loraplane.operator.api import BaseModelSpec
from loraplane.operator.children.base_model import children
from loraplane.serving.http.usage_metrics import UsageCollector
from loraplane.serving.lora.adapter_files import OwnCache
from loraplane.serving.lora.state_metrics import AdapterStateCollector
from loraplane.serving.metrics import NONE, OTHER, EngineMetrics
from loraplane.serving.router.metrics import RouterMetrics
from loraplane.serving.router.table import ReplicaTable
from loraplane.usage import Metering, SegmentExporter

MONITORING = ["monitoring.coreos.com/v1"]
KSM = yaml.safe_load((ROOT / "charts" / "loraplane" / "files" / "kube-state-metrics.yaml").read_text())
# Labels Prometheus adds to every scraped series (the ServiceMonitor's targets), beside the code's own.
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "le"}
# Label values the code writes: arrivals by tier (serving/engine/llm_engine.py), loads by the tier
# they came from (serving/lora/manager.py), residency now (admin_api.Tier).
TIERS = {
    "loraplane_adapter_arrivals_total": {"device", "host", "cold"},
    "loraplane_adapter_load_seconds_count": {"cold", "disk", "host"},
    "loraplane_adapter_load_seconds_bucket": {"cold", "disk", "host"},
}


def exported() -> dict[str, set[str]]:
    """Series name -> label names, from the real collectors after one of everything."""
    engine = EngineMetrics()
    engine.observe_request("a", "t", 5, "device")
    engine.observe_tokens("a", "t", 3)
    engine.observe_load("a", "t", "host", 0.1)
    engine.observe_queue_wait("a", "t", 0.1)
    info = SimpleNamespace(tenant="t", residency=SimpleNamespace(value="device"), pinned=True)
    files = OwnCache(Path(tempfile.mkdtemp()), max_bytes=1 << 30, policy="demand", s3=None)
    adapters = SimpleNamespace(entries={"a": None}, info=lambda _name: info, files=files)
    engine.registry.register(AdapterStateCollector(engine, adapters))  # type: ignore[arg-type]
    table = ReplicaTable()
    table.set_members({"r0": "http://r0:8000"})
    router = RouterMetrics(table)
    router.routed.labels("r0", "device_hit").inc()
    router.retries.labels("r0").inc()
    router.broken_streams.labels("r0").inc()
    usage = CollectorRegistry()
    exporter = SegmentExporter(Path(tempfile.mkdtemp()), "s3://billing/usage", client=object())
    usage.register(UsageCollector(Metering("r0", exporter=exporter)))
    node = CollectorRegistry()
    agent = NodeAgent(Path(tempfile.mkdtemp()), "node-1", max_bytes=1 << 30, base_source="s3://models/base")
    create_agent_app(agent, None, node)
    agent.on_fetch(0.5)  # type: ignore[misc]  # one fetch observed, so the histogram has samples
    series: dict[str, set[str]] = {}
    for registry in (engine.registry, router.registry, usage, node):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    resource = KSM["spec"]["resources"][0]  # kube-state-metrics' series of what the operator writes into status
    for metric in resource["metrics"]:
        each = metric["each"]
        labels = set(resource["labelsFromPath"]) | set(each.get("gauge", {}).get("labelsFromPath", {}))
        labels |= {each["stateSet"]["labelName"]} if "stateSet" in each else set()
        series[f"{resource['metricNamePrefix']}_{metric['name']}"] = labels
    return series


SERIES = exported()
SELECTOR = re.compile(r"\b((?:kube_)?loraplane_[a-z_]+)(?:\{([^}]*)\})?")


def check_query(expr: str) -> None:
    names = SELECTOR.findall(expr)
    assert names, expr
    known_labels = set().union(*SERIES.values()) | TARGET_LABELS
    for name, matchers in names:
        assert name in SERIES, f"{name} is not exported"
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
            assert label in SERIES[name] | TARGET_LABELS, f"{name} has no label {label}"
            if label == "tier" and name in TIERS:
                assert set(value.split("|")) <= TIERS[name], f"{name}: no tier {value}"
            if label == "tenant" and op == "!~":
                assert set(value.split("|")) == {NONE, OTHER}, "the not-a-tenant labels moved"
    for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
        assert {g.strip() for g in group.split(",")} <= known_labels, expr


def rules(render: Any, values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    groups = render(values, MONITORING).one("PrometheusRule")["spec"]["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_no_monitoring_objects_without_the_prometheus_operator(render: Any, notes: Any) -> None:
    objects = render()
    assert objects.kind("ServiceMonitor") == [] and objects.kind("PrometheusRule") == []
    assert "No ServiceMonitor or PrometheusRule was rendered" in notes()
    assert "No ServiceMonitor" not in notes(api_versions=MONITORING)


def test_the_service_monitor_scrapes_the_serving_and_router_services_the_operator_creates(render: Any) -> None:
    monitor = render(api_versions=MONITORING).one("ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}  # BaseModels live in any namespace
    selector = monitor["spec"]["selector"]
    base = BaseModelSpec.model_validate({"source": {"uri": "embedded"}})
    services = [m for m in children("smollm2", "team-a", base) if m["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"smollm2-serving", "smollm2-router"}
    for service in services:
        labels = service["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        for expression in selector["matchExpressions"]:
            assert expression["operator"] == "In" and labels[expression["key"]] in expression["values"]
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    narrowed = render({"monitoring": {"serviceMonitor": {"namespaces": ["team-a"]}}}, MONITORING).one("ServiceMonitor")
    assert narrowed["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_the_alerts_encode_the_failure_modes(render: Any) -> None:
    expected = {"LoraplaneAdapterSlotThrash", "LoraplaneColdStartsForHotTenant", "LoraplaneTenantSaturatesReplica",
                "LoraplaneUsageExportFailing", "LoraplaneNodeCacheHotSetTooLarge"}  # fmt: skip
    assert set(rules(render)) == expected
    with_status = rules(render, {"monitoring": {"prometheusRule": {"adapterStatus": {"enabled": True}}}})
    assert "LoraplaneAdapterRefused" in with_status
    for rule in with_status.values():
        check_query(rule["expr"])
        assert rule["for"] and rule["labels"]["severity"] and rule["annotations"]["summary"]


def test_thresholds_come_from_values(render: Any) -> None:
    tuned = {"monitoring": {"prometheusRule": {"slotThrash": {"loadsPerSecond": 7}, "tenantSaturation": {"share": 0.6}}}}
    found = rules(render, tuned)
    assert "> 7\n" in found["LoraplaneAdapterSlotThrash"]["expr"]
    assert "> 0.6\n" in found["LoraplaneTenantSaturatesReplica"]["expr"]


def test_the_adapter_status_alert_reads_conditions_kube_state_metrics_exports() -> None:
    resource = KSM["spec"]["resources"][0]
    assert resource["groupVersionKind"] == {"group": "loraplane.dev", "version": "v1alpha1", "kind": "LoraAdapter"}
    status = crds()["LoraAdapter"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    phases = next(m for m in resource["metrics"] if m["each"]["type"] == "StateSet")["each"]["stateSet"]["list"]
    assert phases == status["phase"]["enum"]
    assert {"type", "status", "reason"} <= set(status["conditions"]["items"]["properties"])


def dashboard(render: Any, values: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    config_map = render(values).one("ConfigMap")
    return config_map, json.loads(config_map["data"]["loraplane.json"])


def test_the_dashboard_is_a_config_map_grafana_picks_up(render: Any) -> None:
    config_map, board = dashboard(render)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["uid"] == "loraplane"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    moved, _ = dashboard(render, {"monitoring": {"dashboard": {"namespace": "grafana"}}})
    assert moved["metadata"]["namespace"] == "grafana"
    assert render({"monitoring": {"dashboard": {"enabled": False}}}).kind("ConfigMap") == []


@pytest.mark.parametrize(
    ("title", "series"),
    [
        ("Requests/s by adapter", "loraplane_requests_total"),
        ("Where requests found their adapter", "loraplane_adapter_arrivals_total"),
        ("Adapter load time by tier", "loraplane_adapter_load_seconds_bucket"),
        ("Queue wait for the adapter", "loraplane_adapter_queue_wait_seconds_bucket"),
        ("Generated tokens/s by tenant", "loraplane_generation_tokens_total"),
    ],
)
def test_the_dashboard_has_the_panels_operators_ask_for(render: Any, title: str, series: str) -> None:
    _, board = dashboard(render)
    panel = next(p for p in board["panels"] if p["title"].startswith(title))
    assert any(series in t["expr"] for t in panel["targets"])


def test_every_dashboard_query_names_exported_series(render: Any) -> None:
    _, board = dashboard(render)
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 10
    for expr in exprs:
        check_query(expr.replace("$__rate_interval", "5m"))
