"""A third-party load generator made for OpenAI-compatible servers (``guidellm``, as users run
it) completes every request it sends, chat and completions, streamed, with its synthetic data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import tiny_engine

from loraplane.serving.api.app import create_app
from loraplane.serving.http.loopback import serve_app

pytestmark = pytest.mark.slow

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture(scope="module")
def url(tiny_llama: Path, tmp_path_factory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("guidellm")
    app = create_app(lambda: tiny_engine(tiny_llama, cache, max_model_len=256))
    with serve_app(app) as base:
        yield base


def guidellm(url: str, model: str, tokenizer: Path, out: Path, route: str, requests: int = 12) -> dict:
    cmd = [
        str(Path(sys.executable).parent / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={url},model={model},request_format={route}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--profile", "kind=concurrent,streams=3",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["benchmarks"][0]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_completes_every_request(url: str, tiny_llama: Path, tmp_path: Path, route: str) -> None:
    bench = guidellm(url, tiny_llama.name, tiny_llama, tmp_path / "bench.json", route)
    totals = bench["metrics"]["request_totals"]
    assert totals["successful"] == 12 and totals["errored"] == 0 and totals["incomplete"] == 0
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
    assert 0 < ttft["median"] < 60_000
    assert bench["metrics"]["output_token_count"]["successful"]["max"] <= 8
