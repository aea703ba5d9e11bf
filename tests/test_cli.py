"""The ``loraplane`` command as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from loraplane.cli import main

PUBLISHED = """\
GPU slots  host slots  GPU hit  host hit  disk loads  mean load wait/request
        8         100    29.6%     44.4%       12968        32.46 ms
       32         100    54.5%     19.1%       13187        32.22 ms
       32         500    54.5%     44.5%         500         2.54 ms
      128         500    78.2%     20.8%         500         1.83 ms
"""
ROOT = Path(__file__).parents[1]


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_sim_defaults_print_the_published_table_exactly() -> None:
    assert run("sim") == (0, PUBLISHED)


def test_sim_compare_shows_the_cut_against_lru_and_the_distance_to_belady() -> None:
    code, out = run("sim", "--compare")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[7:] if line and not line.startswith(("policy", "lower"))}
    assert set(rows) == {"lru", "lfu", "tinylfu", "demand", "lru+pin16", "tinylfu+pin16", "belady"}
    cuts = {name: float(re.findall(r"([+-]\d+\.\d)%", line)[-1]) for name, line in rows.items()}
    assert min(cuts[p] for p in ("lfu", "tinylfu")) <= -35.0
    assert "lower bound on mean wait" in out


def test_sim_replicas_compares_routings() -> None:
    code, out = run("sim", "--requests", "5000", "--replicas", "3", "--config", "16:50")
    assert code == 0
    assert re.search(r"^round-robin\s+3", out, re.M) and re.search(r"^affinity\s+3", out, re.M)


def test_sim_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "policies.png"
    code, _ = run("sim", "--requests", "3000", "--plot", str(png))
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_sim_reads_a_trace_file(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,adapter,tenant,tokens\n" + "".join(f"{i},a{i % 3},t,1\n" for i in range(30)))
    code, out = run("sim", "--trace", str(trace), "--config", "3:3")
    assert code == 0 and out.splitlines()[1].split()[2] == "90.0%"  # only the first three miss


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,adapter\n1,a\nyesterday,b\n")
    code, out = run("sim", "--trace", str(trace))
    assert code == 1 and "t.csv:3: timestamp" in out and "Traceback" not in out
    code, out = run("sim", "--config", "32")
    assert code == 2 and "is not GPU:HOST" in out


def test_plan_explains_each_decision() -> None:
    code, out = run("plan", str(ROOT / "examples" / "plan-500-finetunes-8b" / "plan.yaml"))
    assert code == 0
    for decision in (
        "- no dedicated deployment: the busiest adapter, customer-000",
        "- rank cap 16",
        "- GPU slots",
        "- host slots",
        "- replicas",
    ):
        assert decision in out
    assert re.search(r"predicted .*\n  GPU hit \d+\.\d%", out)


def test_help_lists_the_subcommands() -> None:
    code, out = run("--help")
    assert code == 0 and "sim" in out and "plan" in out


def test_serve_refuses_tenants_without_an_admin_token(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants: [{name: acme, api_keys: [k]}]\n")
    code, output = run("serve", "--tenants", str(tenants))
    assert code == 2 and "--tenants needs --admin-token" in output
    code, output = run("serve", "--tenants", str(tenants), "--admin-token", "")
    assert code == 2
    code, output = run("router", "--replica", "http://127.0.0.1:1", "--tenants", str(tenants))
    assert code == 2 and "--tenants needs --admin-token" in output


def test_serve_flags_reach_the_engine_config_and_absent_ones_leave_its_defaults(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What ``loraplane serve`` would build the engine from, stopped before any engine or server
    starts: the fair-scheduling flags set the config, and leaving them out keeps its defaults."""
    import uvicorn

    from loraplane.serving.api import app
    from loraplane.serving.engine import builder

    configs = []
    monkeypatch.setattr(builder, "build_engine", lambda config: config)
    monkeypatch.setattr(app, "create_app", lambda factory, **_kw: configs.append(factory()))
    monkeypatch.setattr(uvicorn, "run", lambda *_a, **_kw: None)
    assert run("serve", "--fair-prefill-chunk", "64", "--no-fair-scheduling", "--no-fair-interjection")[0] == 0
    assert run("serve")[0] == 0
    assert run("serve", "--fair-interjection")[0] == 0
    assert [(c.fair_prefill_chunk, c.fair_scheduling, c.fair_interjection) for c in configs] == [
        (64, False, False), (None, True, None), (None, True, True),
    ]  # fmt: skip
    code, output = run("serve", "--fair-prefill-chunk", "0")
    assert code == 2 and "--fair-prefill-chunk" in output


def test_serve_takes_vllms_command_line(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A vLLM command line runs as it is: ``--enable-lora``, ``--lora-modules`` in vLLM's JSON form
    beside NAME=SOURCE, and ``--api-key``, one key that every API call (and, with no admin token
    of their own, the admin calls) must send."""
    import uvicorn

    from loraplane.serving.api import app
    from loraplane.serving.engine import builder
    from loraplane.serving.http.errors import APIError

    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("LORAPLANE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    made: list[tuple[object, dict]] = []
    monkeypatch.setattr(builder, "build_engine", lambda config: config)
    monkeypatch.setattr(app, "create_app", lambda factory, **kw: made.append((factory(), kw)))
    monkeypatch.setattr(uvicorn, "run", lambda *_a, **_kw: None)
    module = '{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}'
    code, output = run("serve", "--enable-lora", "--lora-modules", module, "--lora-modules", "chat=/adapters/chat",
                       "--api-key", "secret")  # fmt: skip
    assert code == 0, output
    config, kw = made[-1]
    assert config.lora_modules == {"sql": "/adapters/sql", "chat": "/adapters/chat"}  # type: ignore[attr-defined]
    tenants = kw["tenants"]
    assert tenants.authenticate("Bearer secret") is not None and kw["admin_token"] == "secret"
    with pytest.raises(APIError, match="Incorrect API key"):
        tenants.authenticate("Bearer wrong")
    assert run("serve", "--api-key", "secret", "--admin-token", "admin")[0] == 0 and made[-1][1]["admin_token"] == "admin"
    assert run("serve")[0] == 0 and made[-1][1]["tenants"].open  # no key: open, as vLLM without --api-key
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text("tenants: [{name: acme, api_keys: [k]}]\n")
    code, output = run("serve", "--api-key", "secret", "--tenants", str(tenants_file), "--admin-token", "a")
    assert code == 2 and "--api-key and --tenants" in output
    for bad in ('{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "{not json", "no-equals-sign"):
        code, output = run("serve", "--lora-modules", bad)
        assert code == 2 and "--lora-modules" in output, bad
    # vLLM's tool calling flags: the parser reaches the server only with --enable-auto-tool-choice,
    # which without a parser is refused, as vLLM refuses it.
    assert run("serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")[0] == 0
    assert made[-1][1]["tool_call_parser"] == "hermes"
    assert run("serve", "--tool-call-parser", "llama3_json")[0] == 0 and made[-1][1]["tool_call_parser"] is None
    code, output = run("serve", "--enable-auto-tool-choice")
    assert code == 2 and "--tool-call-parser" in output
    assert run("serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic")[0] == 0
    assert made[-1][1]["tool_call_parser"] == "pythonic"
    code, output = run("serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral")  # a format not read here
    assert code == 2 and "--tool-call-parser" in output
    # The Responses API's stored responses: kept by default, within the flags' bounds; 0 keeps none.
    assert run("serve")[0] == 0 and made[-1][1]["responses"].enabled
    assert run("serve", "--max-stored-responses", "5", "--stored-responses-mib", "2")[0] == 0
    assert (made[-1][1]["responses"].max_responses, made[-1][1]["responses"].max_bytes) == (5, 2 << 20)
    assert run("serve", "--max-stored-responses", "0")[0] == 0 and not made[-1][1]["responses"].enabled


OPERATOR_IMAGE = """
import sys

class NotInstalled:
    # The operator image's installation: no serving part, no kernels, no torch.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch" or name.startswith(("loraplane.serving", "loraplane.kernels")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
from loraplane.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("args", [["--help"], ["operator", "--help"], ["crds", "--help"], ["digest", "--help"]])
def test_the_operator_images_commands_run_without_the_serving_part(args: list[str]) -> None:
    """The operator image installs no serving part: its `loraplane` must still start (it once
    imported serving for every command, and the operator pod crashed on its first start)."""
    r = subprocess.run([sys.executable, "-c", OPERATOR_IMAGE, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Usage:" in r.stdout


def test_a_command_whose_part_is_missing_names_the_part() -> None:
    r = subprocess.run([sys.executable, "-c", OPERATOR_IMAGE, "serve", "--port", "8000"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 1
    assert "`loraplane serve` needs loraplane-serving" in r.stderr
    assert "Traceback" not in r.stderr
    listing = subprocess.run([sys.executable, "-c", OPERATOR_IMAGE, "--help"], capture_output=True, text=True, timeout=120)
    assert "not installed here: needs loraplane-serving" in listing.stdout
