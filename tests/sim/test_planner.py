"""The planner's decisions on small inputs whose answers are worked out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loraplane.sim.plan_input import PlanInputError, load_plan_input
from loraplane.sim.planner import make_plan, predict

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2}


def spec_file(tmp_path: Path, **overrides: Any) -> Path:
    spec: dict[str, Any] = {
        "base": BASE,
        "budget": {"gpu_adapter_memory_gib": 0.05, "host_memory_gib": 1, "max_replicas": 4, "replica_rps": 20},
        "knobs": {"requests_to_simulate": 2000},
        "adapters": [
            {"name": "big", "rps": 30, "rank": 8, "size_mb": 10},
            {"name": "a", "rps": 5, "rank": 8, "size_mb": 10},
            {"name": "b", "rps": 3, "rank": 16, "size_mb": 20},
            {"name": "c", "rps": 1.9, "rank": 8, "size_mb": 10},
            {"name": "d", "rps": 0.1, "rank": 64, "size_mb": 80},
        ],
    }
    spec.update(overrides)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_decisions_on_a_hand_worked_fleet(tmp_path: Path) -> None:
    spec = load_plan_input(spec_file(tmp_path))
    plan = make_plan(spec)
    # big: 30 of 40 req/s = 75% >= 25% -> dominant; the whole base needs ceil(40 / (20 x 0.7)) = 3
    # replicas, of which its share is 2.25 -> a merged deployment of 2
    assert [(a.name, n) for a, n in plan.merged] == [("big", 2)]
    assert [a.name for a in plan.shared] == ["a", "b", "c", "d"]
    # ranks <= 16 carry 9.9 of 10 req/s = 99% -> cap 16; d (rank 64) is above it
    assert plan.rank_cap == 16 and [a.name for a in plan.above_cap] == ["d"]
    # 1.25 MB per rank (a: 10/8) -> 20 MB slots, 80 MB uncapped
    assert (plan.slot_mb, plan.slot_mb_uncapped) == (20, 80)
    # 0.05 GiB x 0.9 = 46.08 MB -> 2 slots; host holds all four
    assert (plan.gpu_slots, plan.host_slots, plan.replicas) == (2, 4, 1)
    assert len(plan.reasons) == 5 and plan.reasons[0].startswith("merge big")
    predicted = predict(plan, spec)
    assert predicted is not None and predicted.cold_loads == 4  # each shared adapter loads once


def test_small_host_tier_is_flagged_and_replicas_are_capped(tmp_path: Path) -> None:
    path = spec_file(
        tmp_path,
        budget={"gpu_adapter_memory_gib": 0.05, "host_memory_gib": 0.02, "max_replicas": 1, "replica_rps": 5},
        knobs={"dedicated_share": 1.0},
    )
    plan = make_plan(load_plan_input(path))
    assert plan.merged == [] and plan.host_slots == 1  # 0.02 GiB x 0.9 = 18.4 MB: one 10 MB adapter
    host_line = next(r for r in plan.reasons if r.startswith("host slots"))
    assert "add host memory first" in host_line
    replica_line = next(r for r in plan.reasons if r.startswith("replicas"))
    assert "would be needed, the budget caps it at 1" in replica_line


def test_one_dominant_adapter_at_most_and_none_from_a_one_replica_pool(tmp_path: Path) -> None:
    two_big = [{"name": "x", "rps": 12, "rank": 8}, {"name": "y", "rps": 10, "rank": 8}, {"name": "z", "rps": 8, "rank": 8}]
    plan = make_plan(load_plan_input(spec_file(tmp_path, adapters=two_big)))
    # x 40%, y 33%, z 27%: all above 25%, but max_dedicated is 1: the largest share goes; the pool
    # for all 30 req/s is ceil(30 / 14) = 3 replicas, of which 40% is 1.2 -> 1
    assert [(a.name, n) for a, n in plan.merged] == [("x", 1)] and [a.name for a in plan.shared] == ["y", "z"]
    plan = make_plan(load_plan_input(spec_file(tmp_path, adapters=two_big, knobs={"max_dedicated": 2})))
    assert [(a.name, n) for a, n in plan.merged] == [("x", 1), ("y", 1)]
    small = [{"name": "x", "rps": 3, "rank": 8}, {"name": "y", "rps": 1, "rank": 8}]
    plan = make_plan(load_plan_input(spec_file(tmp_path, adapters=small)))
    assert plan.merged == [] and plan.reasons[0].startswith("keep x shared: it carries 75.0% of requests")
    quiet = [{"name": "x", "rps": 0.3, "rank": 8}, {"name": "y", "rps": 0.1, "rank": 8}]
    plan = make_plan(load_plan_input(spec_file(tmp_path, adapters=quiet)))
    assert plan.merged == [] and "under the 25% (and 1 req/s)" in plan.reasons[0]


def test_the_old_merge_knob_names_its_replacement(tmp_path: Path) -> None:
    with pytest.raises(PlanInputError, match="merge_replica_fraction was replaced by dedicated_share"):
        load_plan_input(spec_file(tmp_path, knobs={"merge_replica_fraction": 0.5}))


def test_shares_need_a_total_rate(tmp_path: Path) -> None:
    path = spec_file(tmp_path, adapters=[{"name": "a", "share": 1.0, "rank": 8}])
    with pytest.raises(PlanInputError, match="total_rps is required"):
        load_plan_input(path)
    path = spec_file(tmp_path, adapters=[{"name": "a", "share": 1.0, "rank": 8}], total_rps=5)
    plan = make_plan(load_plan_input(path))
    # size from the base: rank 8 x 1024 values per layer x 2 layers x 2 bytes
    assert plan.slot_mb == pytest.approx(8 * 1024 * 2 * 2 / 2**20)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("name,rps,rank\na,1,8\nb,fast,8\n", r"adapters\.csv:3: rps: Input should be a valid number"),
        ("name,rps,rank\na,1,0\n", r"adapters\.csv:2: rank: Input should be greater than 0"),
        ("name,rps,share,rank\na,1,0.5,8\n", r"adapters\.csv:2: row: Value error, give exactly one of share or rps"),
        ("name,rps,rank\na,1,8\na,2,8\n", r"adapter 'a' appears more than once"),
        ("name,rps,rank\n", r"the adapter table is empty"),
    ],
)
def test_bad_adapter_tables_name_the_line(tmp_path: Path, rows: str, message: str) -> None:
    (tmp_path / "adapters.csv").write_text(rows)
    with pytest.raises(PlanInputError, match=message):
        load_plan_input(spec_file(tmp_path, adapters="adapters.csv"))


def test_bad_spec_names_the_field(tmp_path: Path) -> None:
    path = spec_file(tmp_path, budget={"gpu_adapter_memory_gib": -1, "host_memory_gib": 1, "max_replicas": 1, "replica_rps": 1})
    with pytest.raises(PlanInputError, match=r"budget\.gpu_adapter_memory_gib: Input should be greater than 0"):
        load_plan_input(path)


def test_the_shipped_example_plans(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "examples" / "plan-500-finetunes-8b" / "plan.yaml"
    spec = load_plan_input(example)
    plan = make_plan(spec)
    assert len(spec.fine_tunes()) == 500
    assert plan.rank_cap == 16 and plan.gpu_slots > 4 * 23 - 10  # the cap buys about four times the slots
    assert plan.host_slots == len(plan.shared)
