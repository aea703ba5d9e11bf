"""The default trace generator against the published table, and trace files users bring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplane.sim.trace import TraceFormatError, cumulative, lcg_uniform, load_trace, sample_index, zipf_trace, zipf_weights


def test_lcg_matches_the_reference_recurrence() -> None:
    draw = lcg_uniform(11)
    s = 11
    for _ in range(1000):
        s = (s * 1664525 + 1013904223) % 2**32
        assert next(draw) == s / 2**32
    first = next(lcg_uniform(11))
    assert first == ((11 * 1664525 + 1013904223) % 2**32) / 2**32


def test_zipf_table_and_binary_search() -> None:
    cdf = cumulative(zipf_weights(500, 1.1))
    assert len(cdf) == 500 and cdf == sorted(cdf)
    assert cdf[-1] == pytest.approx(1.0, abs=1e-12)
    assert sample_index(cdf, 0.0) == 0
    assert sample_index(cdf, cdf[0]) == 0  # "not below u": equal counts
    assert sample_index(cdf, cdf[0] + 1e-15) == 1
    assert sample_index(cdf, 1.0) == 499


def test_default_trace_is_the_published_one() -> None:
    trace = zipf_trace()
    assert len(trace) == 50_000 and len(trace.names) == 500
    counts = trace.request_counts()
    assert trace.hottest(3) == [0, 1, 2]
    assert counts[0] / len(trace) == pytest.approx(1 / sum(zipf_weights(500, 1.1)), rel=0.05)
    assert trace.adapters[:5] == zipf_trace(num_requests=5).adapters  # a prefix is the same draws
    assert trace.timestamps == sorted(trace.timestamps)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_csv_and_jsonl_traces_load_in_time_order(tmp_path: Path) -> None:
    csv_path = write(tmp_path, "t.csv", "timestamp,adapter,tenant,tokens\n2.0,b,acme,10\n1.0,a,acme,5\n3,a,globex,7\n")
    trace = load_trace(csv_path)
    assert [trace.names[a] for a in trace.adapters] == ["a", "b", "a"]
    assert trace.tenants == ["acme", "acme", "globex"] and trace.tokens == [5, 10, 7]
    rows = [{"timestamp": 0.5, "adapter": "x", "tenant": "t", "tokens": 3}, {"timestamp": 0.1, "adapter": "y"}]
    jsonl = write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = load_trace(jsonl)
    assert [trace.names[a] for a in trace.adapters] == ["y", "x"] and trace.tenants == ["default", "t"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "bad.csv",
            "timestamp,adapter,tenant,tokens\n1,a,t,5\nsoon,b,t,5\n",
            r"bad\.csv:3: timestamp: Input should be a valid number",
        ),
        (
            "neg.csv",
            "timestamp,adapter,tenant,tokens\n1,a,t,-5\n",
            r"neg\.csv:2: tokens: Input should be greater than or equal to 0",
        ),
        ("noadapter.csv", "timestamp,tenant\n1,t\n", r"noadapter\.csv:2: adapter: Field required"),
        ("extra.csv", "timestamp,adapter\n1,a,surprise\n", r"extra\.csv:2: more fields than the header has"),
        ("col.csv", "timestamp,adapter,colour\n1,a,red\n", r"col\.csv:2: colour: Extra inputs are not permitted"),
        ("bad.jsonl", '{"timestamp": 1, "adapter": "a"}\n{"timestamp": 2, "adapter": \n', r"bad\.jsonl:2: not valid JSON"),
        ("list.jsonl", "[1, 2]\n", r"list\.jsonl:1: expected a JSON object, got list"),
        ("empty.csv", "", r"empty\.csv:1: empty file"),
        ("header.csv", "timestamp,adapter\n", r"header\.csv: no requests in trace"),
        ("trace.parquet", "x", r"unknown trace format '\.parquet'"),
    ],
)
def test_bad_trace_files_name_the_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        load_trace(write(tmp_path, name, text))


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "nope.csv")
