"""The operator's decisions with plain inputs: status figures from the replicas' counters, when a write
is worth it, what a replica lacks, the auto-pinned hot set, and condition transition times."""

from __future__ import annotations

import pytest

from loraplane.admin_api import Counters
from loraplane.operator.api.loraadapter import AdapterMetrics
from loraplane.operator.runtime.conditions import set_condition
from loraplane.operator.runtime.decisions import Sample, hot_set, metrics, missing, sample, unclaimed, worth_writing


def entry(
    requests: int,
    device: int,
    host: int = 0,
    cold: int = 0,
    loads: tuple[int, float] = (0, 0.0),
    recent: list[float] | None = None,
) -> Counters:
    """One replica's counters for an adapter, as its ``/admin/stats`` reads."""
    return Counters.model_validate({
        "requests": requests, "prompt_tokens": 10 * requests, "completion_tokens": 4 * requests,
        "device_hits": device, "host_hits": host, "cold_loads": cold,
        "load_seconds": {"host": {"count": loads[0], "sum": loads[1]}}, "recent_load_ms": recent or [],
    })  # fmt: skip


def test_counters_sum_over_replicas_and_rates_come_from_the_interval() -> None:
    first = sample(0.0, [entry(10, 8, 1, 1, (2, 0.2)), entry(5, 5)])
    assert (first.counters.requests, first.counters.device_hits, first.counters.loads) == (15, 13, 2)
    later = sample(10.0, [entry(30, 26, 2, 2, (4, 0.4)), entry(15, 15)])
    m = metrics(first, later, "2026-11-29T00:00:00Z")
    assert m.requests_per_second == 3.0  # 30 more requests in 10 s
    assert m.device_hit_rate == pytest.approx(41 / 45, abs=1e-4) and m.host_hit_rate == pytest.approx(2 / 45, abs=1e-4)
    assert m.cold_loads == 2 and m.load_latency_mean_ms == 100.0 and m.completion_tokens == 180


def test_load_latency_percentiles_pool_every_replicas_recent_loads() -> None:
    slow_one, fast = entry(1, 0, cold=1, recent=[250.0]), entry(99, 90, host=9, recent=[2.0] * 30)
    m = metrics(None, sample(0.0, [slow_one, fast]), "t")
    assert (m.load_latency_p50_ms, m.load_latency_p99_ms) == (2.0, 250.0)  # the mean alone would hide the slow cold load
    assert metrics(None, sample(0.0, [entry(1, 1)]), "t").load_latency_p99_ms is None  # no loads, no figure


def test_a_restarted_replica_does_not_make_a_negative_rate() -> None:
    before, after = Sample(0.0, Counters(requests=100)), Sample(5.0, Counters(requests=10))
    assert metrics(before, after, "t").requests_per_second == 2.0


def test_no_previous_sample_means_no_rate_yet_and_no_hits_means_no_hit_rate() -> None:
    m = metrics(None, Sample(at=1.0), "t")
    assert m.requests_per_second == 0.0 and m.device_hit_rate is None


@pytest.mark.parametrize(
    ("old", "new", "write"),
    [
        (None, {}, False),  # an adapter nobody called yet: nothing to show, no write
        (None, {"completion_tokens": 4}, True),
        ({"requests_per_second": 10.0}, {"requests_per_second": 10.4}, False),  # 4%: noise
        ({"requests_per_second": 10.0}, {"requests_per_second": 12.0}, True),
        ({"device_hit_rate": 0.90}, {"device_hit_rate": 0.91}, False),
        ({"device_hit_rate": 0.90}, {"device_hit_rate": 0.70}, True),
        ({"cold_loads": 3}, {"cold_loads": 4}, True),
        ({"completion_tokens": 10_000}, {"completion_tokens": 10_050}, False),
        ({"device_hit_rate": None}, {"device_hit_rate": 0.5}, True),
    ],
)
def test_status_is_written_only_when_a_figure_moved(old: dict | None, new: dict, write: bool) -> None:
    assert worth_writing(AdapterMetrics(**old) if old is not None else None, AdapterMetrics(**new)) is write


def test_missing_lists_ready_adapters_a_replica_lacks() -> None:
    assert missing(["a", "c"], ["c", "b", "a", "d"]) == ["b", "d"]


def test_names_no_adapter_claims_are_the_ones_to_unregister() -> None:
    assert unclaimed(["gone", "kept", "old-name"], ["kept", "new-name", "pending"]) == ["gone", "old-name"]
    assert unclaimed([], ["a"]) == [] and unclaimed(["a"], ["a"]) == []


def test_hot_set_takes_the_hottest_and_holds_pins_with_hysteresis() -> None:
    rates = {"a": 10.0, "b": 8.0, "c": 7.5, "d": 0.0}
    assert hot_set(rates, 2, [], 0.2) == {"a", "b"}
    assert hot_set(rates, 2, ["a", "c"], 0.2) == {"a", "c"}  # c (7.5 x 1.2 = 9) keeps its pin against b (8)
    assert hot_set({**rates, "b": 9.5}, 2, ["a", "c"], 0.2) == {"a", "b"}  # a clear winner takes it
    assert hot_set(rates, 10, [], 0.2) == {"a", "b", "c"}  # idle adapters are never pinned
    assert hot_set(rates, 0, ["a"], 0.2) == set()


def test_a_conditions_transition_time_moves_only_when_its_status_does() -> None:
    first = set_condition([], "Ready", "False", "NoReadyReplicas", "waiting", 1)
    first[0].last_transition_time = "2026-01-01T00:00:00Z"
    same = set_condition(first, "Ready", "False", "ReplicaError", "still waiting", 2)
    assert same[0].last_transition_time == "2026-01-01T00:00:00Z" and same[0].reason == "ReplicaError"
    flipped = set_condition(same, "Ready", "True", "Serving", "", 2)
    assert flipped[0].last_transition_time != "2026-01-01T00:00:00Z" and len(flipped) == 1


def test_a_small_change_waits_for_the_refresh_and_an_idle_adapter_never_writes() -> None:
    shown = metrics(None, sample(0.0, [entry(100, 90, host=9, cold=1)]), "t")
    crept = metrics(None, sample(1.0, [entry(101, 91, host=9, cold=1)]), "t")  # 4 more tokens: not worth a write yet
    assert not worth_writing(shown, crept)
    assert worth_writing(shown, crept, refresh_due=True)  # late, not lost
    same = metrics(None, sample(2.0, [entry(100, 90, host=9, cold=1)]), "later")
    assert not worth_writing(shown, same, refresh_due=True)  # nothing changed but the timestamp


def test_node_staging_puts_pins_first_then_the_hot_set_then_prefetch_then_next_versions() -> None:
    from loraplane.operator.runtime.decisions import StagingCandidate, node_staging

    d = "sha256:" + "0" * 64
    staged = node_staging([
        StagingCandidate("s3://a/cold", d),  # unpinned, unused, not prefetch-marked: fetched on demand only
        StagingCandidate("s3://a/next", "sha256:" + "1" * 64, next_version=True),
        StagingCandidate("s3://a/warm", d, rate=0.5, prefetch=True),
        StagingCandidate("s3://a/idle", d, prefetch=True),
        StagingCandidate("s3://a/hot", d, rate=9.0),
        StagingCandidate("s3://a/pinned", d, pinned=True),
        StagingCandidate("s3://a/hot", d, rate=9.0, next_version=True),  # one version, at its best rank
    ])  # fmt: skip
    assert [c.source for c in staged] == ["s3://a/pinned", "s3://a/hot", "s3://a/warm", "s3://a/idle", "s3://a/next"]


def test_a_version_waiting_for_promotion_is_staged_beside_the_serving_one() -> None:
    from types import SimpleNamespace

    from loraplane.operator.api.loraadapter import LoraAdapterSpec, LoraAdapterStatus
    from loraplane.operator.runtime.node_cache_sync import candidates

    old, new = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    spec = LoraAdapterSpec.model_validate({"baseModel": "b", "tenant": "t", "source": {"uri": "s3://x/v2", "digest": new}})
    status = LoraAdapterStatus(phase="Ready", serving_uri="s3://x/v1", serving_digest=old, promoting_digest=new)
    found = candidates([SimpleNamespace(served="s", spec=spec, status=status)], pins={"s"}, rates={"s": 2.0})
    assert [(c.source, c.digest, c.pinned, c.next_version) for c in found] == [
        ("s3://x/v1", old, True, False),
        ("s3://x/v2", new, False, True),
    ]
    failed = LoraAdapterStatus(phase="Failed")
    assert candidates([SimpleNamespace(served="s", spec=spec, status=failed)], pins=set(), rates={}) == []
