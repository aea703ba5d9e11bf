"""``--step-trace``: the record of a server's steps adds up to the work the engine did, and the
report reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine_helpers import tiny_engine

from loraplane.serving.engine.sampling_params import SamplingParams

REPORT = Path(__file__).parents[2] / "benchmarks" / "step_trace_report.py"


def test_the_trace_accounts_for_every_prompt_token_decode_and_first_token(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Four requests (two on adapters, one prompt chunked by a small token budget, one prompt of a
    single token): one arrival each, with its adapter and prompt length; the steps' prompt tokens
    add up to the prompts' (the one-token prompt counted as a prompt, not a decode), their
    decodes to every token after the first, and each request's first token is given by exactly
    one step, the one that finished its prompt. The report reads the file."""
    trace = tmp_path / "steps.jsonl"
    engine = tiny_engine(tiny_llama, tmp_path, tiny_adapters, step_trace=trace, max_num_batched_tokens=16)
    prompts = [list(range(5, 45)), list(range(50, 62)), list(range(70, 79)), [81]]
    adapters = ["qv4", None, "all8", None]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), adapters)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    arrivals = [e for e in events if e["event"] == "arrival"]
    steps = [e for e in events if e["event"] == "step"]
    assert [(a["adapter"], a["prompt_tokens"]) for a in arrivals] == list(zip(adapters, map(len, prompts), strict=True))
    assert sum(s["prompt_tokens"] for s in steps) == sum(map(len, prompts))
    assert sum(s["prompts"] for s in steps) >= len(prompts)
    assert sum(s["decodes"] for s in steps) == sum(len(o.token_ids) - 1 for o in outs)
    firsts = [r for s in steps for r in s["first_tokens"]]
    assert sorted(firsts) == sorted(a["request"] for a in arrivals)
    chunked = next(s for s in steps if arrivals[0]["request"] in s["first_tokens"])
    assert steps.index(chunked) >= 2  # 40 prompt tokens at 16 a step: its first token comes from the third step
    assert all(s["ms"] > 0 and s["t"] >= arrivals[0]["t"] for s in steps)
    assert {a for s in steps for a in s["adapters"]} == {"qv4", "all8"}
    report = subprocess.run([sys.executable, str(REPORT), str(trace)], capture_output=True, text=True, check=True)
    assert "first tokens: 4 of 4 requests" in report.stdout
