"""`loraplane bench` against the real server on loopback: every request is counted once, under its
tenant, and the tiers the report shows are the ones the server saw for the same requests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from engine_helpers import tiny_engine

from loraplane.cli import main
from loraplane.serving.api.app import create_app
from loraplane.serving.bench.deployment import Deployment, _wait_ready, child_command
from loraplane.serving.bench.run import bench_in_process
from loraplane.serving.bench.workload import BenchRequest, zipf_requests
from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import Tenants, load_tenants
from loraplane.serving.lora.entries import AdapterSpec


def test_in_process_bench_reports_what_the_server_saw(tiny_llama: Path, tmp_path: Path) -> None:
    config = EngineConfig(
        model=str(tiny_llama), dtype="float32", cache_dir=tmp_path, max_loras=2, max_cpu_loras=4, max_lora_rank=64,
        block_size=4, num_kv_blocks=256,
    )  # fmt: skip
    sent: list[BenchRequest] = []

    def workload(d: Deployment) -> list[BenchRequest]:
        sent.extend(zipf_requests(d.models, d.owners, 30, rate=40, prompt_words=8, max_tokens=4))
        return sent

    report = bench_in_process(config, 8, 3, workload, progress=False)
    assert (report.overall.requests, report.overall.ok, report.overall.completion_tokens) == (30, 30, 120)
    per_adapter = Counter(r.model for r in sent)
    assert {name: t.arrivals for name, t in report.per_adapter.items()} == per_adapter
    assert {name: t.requests for name, t in report.per_adapter.items()} == per_adapter
    assert {name: v.requests for name, v in report.per_tenant.items()} == Counter(r.tenant for r in sent)
    tiers = report.tiers
    assert tiers.cold_loads >= len(per_adapter)  # every adapter starts cold
    assert tiers.device_hits > 0  # and the Zipf head is found on the device again
    assert 0 < report.overall.ttft_p50_ms <= report.overall.ttft_p99_ms
    assert report.overall.itl_p50_ms > 0


def test_bench_cli_drives_a_running_server_as_each_tenant(
    tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    tenants = {"tenants": [{"name": "acme", "api_keys": ["key-acme"]}, {"name": "globex", "api_keys": ["key-globex"]}]}
    (tmp_path / "tenants.json").write_text(json.dumps(tenants))

    def make():  # type: ignore[no-untyped-def]
        engine = tiny_engine(tiny_llama, tmp_path / "cache")
        engine.register_lora(AdapterSpec("acme-a", str(tiny_adapters["qv4"]), tenant="acme"))
        engine.register_lora(AdapterSpec("acme-b", str(tiny_adapters["all8"]), tenant="acme"))
        engine.register_lora(AdapterSpec("globex-a", str(tiny_adapters["mlp16"]), tenant="globex"))
        return engine

    app = create_app(make, admin_token="admin-secret", tenants=Tenants(load_tenants(tmp_path / "tenants.json")))
    with serve_app(app) as url:
        args = ["bench", "--url", url, "--tenants", str(tmp_path / "tenants.json"), "--admin-token", "admin-secret"]
        args += [
            "--requests",
            "16",
            "--rate",
            "40",
            "--max-tokens",
            "3",
            "--prompt-words",
            "6",
            "--json",
            str(tmp_path / "r.json"),
        ]
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "16 requests in" in result.output and "16 ok" in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["per_tenant"]) == {"acme", "globex"}
    assert set(report["per_adapter"]) <= {"acme-a", "acme-b", "globex-a"}
    assert sum(t["device_hits"] + t["host_hits"] + t["cold_loads"] for t in report["per_adapter"].values()) == 16


def test_a_server_whose_engine_cannot_start_says_so_and_is_not_waited_for(tmp_path: Path) -> None:
    """A server stays up when its engine fails to start, to say why; ``/ready`` names the failure
    with its own code, and a bench waiting for the server stops at once with that reason instead
    of waiting out its start timeout (what a broken dependency once made a CI run do)."""

    def broken() -> LLMEngine:
        raise ImportError("cannot import name 'CUDAProperties' from 'kernels'")

    log = tmp_path / "server.log"
    log.write_text("the server's own log\n")
    with serve_app(create_app(broken), ready_path="/health") as url:
        for _ in range(100):
            ready = httpx.get(f"{url}/ready")
            if ready.json()["error"]["code"] != "not_ready":
                break
            time.sleep(0.1)
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "engine_failed"
        assert "CUDAProperties" in ready.json()["error"]["message"]
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the process that stays up
        try:
            with pytest.raises(RuntimeError, match=r"(?s)the engine failed to start: ImportError.*server's own log"):
                _wait_ready(url, bystander, log, timeout=60)
        finally:
            bystander.kill()


def test_nothing_at_the_repository_root_shadows_a_package() -> None:
    """From the repository root, with the root on ``sys.path`` as ``python -c`` puts it (and as the
    harnesses' children ran before), ``import operator, kernels`` gets the standard library's
    ``operator`` and Hugging Face's ``kernels`` (transformers 5.25 requires it and imports it), not
    our folders: every part lives in ``<part>/src/loraplane/<part>``, so no root folder is a
    package. (Before, the root ``kernels/`` was, and a spawned server's engine failed to start.)"""
    root = Path(__file__).resolve().parents[2]
    probe = (
        "import json, operator, kernels, importlib.metadata as m; "
        "from transformers.utils.import_utils import is_kernels_available as hub; "
        "print(json.dumps([operator.__file__, getattr(kernels, '__file__', None), "
        "[d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] == 'kernels'], hub()]))"
    )
    for command in ([sys.executable, "-c", probe], [*child_command("serve")[:2], "-c", probe]):
        out = subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout
        operator_file, kernels_file, installed, hub_kernels = json.loads(out)
        assert Path(operator_file).name == "operator.py" and not Path(operator_file).is_relative_to(root)
        # Hugging Face's when installed (transformers 5.25 requires it); otherwise at most an empty
        # namespace, which transformers does not take for hub kernels.
        assert (kernels_file is not None and "site-packages" in kernels_file) if installed else kernels_file is None
        assert installed or not hub_kernels
