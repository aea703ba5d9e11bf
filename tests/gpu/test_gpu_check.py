"""``benchmarks/gpu_check.py`` without a GPU: the overhead part's code end to end at toy sizes on the
CPU kernels (its undocumented ``--device cpu`` smoke mode), and the dry run's verdict on proofs that
fail or are missing. The dry run itself is not run here: its proofs are tests of this suite already.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_overhead_part_runs_on_the_cpu_kernels(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    args = ["--device", "cpu", "--quick", "--only", "overhead", "--rounds", "1", "--json", str(out), "--work-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=SCRIPT.parents[1], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("machine: CPU")
    assert "=== 3. multi-LoRA overhead of an 8B model's layers ===" in lines
    assert sum(line.startswith("seed mix  fp32   ") for line in lines) == 5  # four projections and their total
    assert any(line.startswith("multi-LoRA overhead <= 10% over the base layers: ") for line in lines)
    assert lines[-1].startswith("gpu_check: OK")
    result = json.loads(out.read_text())
    part = result["parts"]["overhead"]
    assert result["ok"] and part["ok"] and set(result["parts"]) == {"overhead"}
    assert part["rows"][0]["base_us"] > 0 and part["rows"][0]["lora_us"] > 0
    assert part["overhead_goal"]["met"] in (True, False)


def test_the_dry_run_fails_on_a_failing_or_missing_proof(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check = _gpu_check()
    # The proofs' own settings, as the repository's pytest configuration gives them to the real ones.
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    proof = tmp_path / "test_gpu_check_proof.py"
    proof.write_text("def test_holds():\n    assert True\n\n\ndef test_breaks():\n    assert 1 == 2\n")
    missing = tmp_path / "test_not_written_yet.py"

    assert not gpu_check.dry_run({"demo proof": proof, "later proof": missing})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"gpu_check dry-run: demo proof 1/2 passed; later proof missing ({missing}); FAILED: ")
    assert "test_gpu_check_proof.py::test_breaks" in line and f"{missing} missing" in line

    passing = tmp_path / "test_gpu_check_passing.py"  # a new name: pytest keeps the first file's module imported
    passing.write_text("def test_holds():\n    assert True\n")
    assert gpu_check.dry_run({"demo proof": passing})
    assert capsys.readouterr().out.strip().splitlines()[-1] == "gpu_check dry-run: demo proof 1/1 passed; OK"


@pytest.mark.slow
def test_the_serving_part_runs_every_engine_on_the_cpu(tmp_path: Path) -> None:
    """Part 4 at toy sizes on the CPU kernels: every engine it sets side by side on a GPU is built
    and serves the trace (bf16 and FP8, graphs off, async scheduling, all resident), so a lent
    GPU's few minutes are not lost to a script that breaks after the first engine."""
    args = ["--device", "cpu", "--quick", "--only", "serving", "--requests", "16", "--output-len", "8", "--adapters", "20"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--work-dir", str(tmp_path)], cwd=SCRIPT.parents[1], capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("median generated tok/s", 1)[1].split("ceilings:", 1)[0]
    for engine in ("graphs on ", "fp8, graphs on", "graphs off", "graphs on, async scheduling", "all adapters resident"):
        assert engine in table, f"{engine!r} missing from part 4's table:\n{table}"
    assert "FAILED" not in proc.stdout and "parts failed: none" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("gpu_check: OK")


def test_the_step_profile_runs_on_the_cpu() -> None:
    """``benchmarks/gpu_step_profile.py``, the GPU recipe's look at where a serving step's time
    goes, checked on the CPU (its ``--device cpu`` mode), where it had broken unnoticed."""
    script = SCRIPT.with_name("gpu_step_profile.py")
    proc = subprocess.run(
        [sys.executable, str(script), "--device", "cpu"], cwd=SCRIPT.parents[1], capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "decode-only steps:" in proc.stdout and "Self CPU time total" in proc.stdout
