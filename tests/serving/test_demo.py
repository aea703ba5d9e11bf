"""The main job: `loraplane demo` trains three style adapters with PEFT on the embedded base, and the
same question under each comes back in three recognisably different styles, served by the real
server to three tenants."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loraplane.serving.demo.run import mixed_requests, run_demo, showcase_requests
from loraplane.serving.demo.styles import SHOWCASE, STYLES, training_questions

PLAIN = "The ocean is a vast body of water. It covers most of the planet, and it is home to whales"


def test_each_style_is_recognisable_and_no_other_style_matches_it() -> None:
    assert not any(style.looks_right(PLAIN) for style in STYLES)
    for style in STYLES:
        text = style.rewrite(PLAIN)
        assert [s.name for s in STYLES if s.looks_right(text)] == [style.name], text


def test_showcase_questions_are_not_in_the_training_data() -> None:
    assert not set(SHOWCASE) & set(training_questions())


def test_the_showcase_spreads_the_base_questions_over_the_tenants() -> None:
    """Fair admission serves the heaviest tenant last; billing every base question to the hot
    customer's owner would make the hot customer wait for the showcase."""
    base = [r for r in showcase_requests("the-base") if r.model == "the-base"]
    assert Counter(r.tenant for r in base) == Counter(s.tenant for s in STYLES)


def test_the_base_is_probed_as_often_as_the_hot_customer_while_the_traffic_runs() -> None:
    """The demo's last line sets the hot customer's p99 beside the base's. The Zipf traffic alone
    gives the base 3 requests to the hot customer's 27, and a largest-of-3 against a largest-of-27
    read above 1.5x in 37 to 68% of resampled draws with no placement cost at all."""
    traffic = mixed_requests("the-base", rate=1.0, num_requests=48)
    hot = [r for r in traffic if r.model == STYLES[0].name]
    base = [r for r in traffic if r.model == "the-base"]
    assert len(hot) == 27 and len(base) == len(hot) + 3
    assert [r.at for r in traffic] == sorted(r.at for r in traffic)
    span = max(r.at for r in traffic if r.model != "the-base")
    in_first_half = sum(r.at < span / 2 for r in base)
    assert 8 <= in_first_half <= 22, in_first_half  # over the traffic's whole stretch, not bunched
    assert max(r.at for r in base) < 1.5 * span
    assert max(Counter(r.tenant for r in base).values()) <= 13  # spread over the tenants, not billed to one


@pytest.mark.slow
def test_demo_trains_three_styles_and_serves_them_as_three_tenants(tmp_path: Path) -> None:
    """About three minutes on two cores: three trainings, then the demo's workload on loopback."""
    report, outcomes = run_demo(tmp_path / "out", adapters_dir=tmp_path / "adapters", num_requests=12, rate=4)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    by_name = {s.name: s for s in STYLES}
    showcase = [o for o in outcomes if o.request.at == 0.0]
    assert len(showcase) == len(SHOWCASE) * (len(STYLES) + 1)
    for o in showcase:
        matches = [s.name for s in STYLES if s.looks_right(o.text)]
        expected = [o.request.model] if o.request.model in by_name else []  # the base has no style
        assert matches == expected, (o.request.model, o.request.prompt, o.text)
    sent = Counter(o.request.model for o in outcomes if o.request.model in by_name)
    assert {name: t.arrivals for name, t in report.per_adapter.items()} == sent
    assert {name: v.requests for name, v in report.per_tenant.items()} == Counter(o.request.tenant for o in outcomes)
    assert (tmp_path / "out" / "demo.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(saved["answers"]) == len(outcomes)
