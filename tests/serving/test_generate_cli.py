"""``loraplane generate``: a completion from the shell, with and without an adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from loraplane.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_CACHE", str(tmp_path / "cache"))


def test_generate_with_and_without_an_adapter(tiny_llama: Path, tiny_adapters: dict[str, Path]) -> None:
    runner = CliRunner()
    base = runner.invoke(main, ["generate", "--model", str(tiny_llama), "--max-tokens", "12", "the quick brown fox"])
    assert base.exit_code == 0, base.output
    tuned = runner.invoke(
        main,
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--adapter",
            str(tiny_adapters["all8"]),
            "--max-tokens",
            "12",
            "the quick brown fox",
        ],
    )
    assert tuned.exit_code == 0, tuned.output
    assert "12 tokens" in tuned.stderr
    assert base.stdout != tuned.stdout  # the adapter changes the answer


def test_generate_reports_a_bad_adapter_clearly(tiny_llama: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-adapter"
    empty.mkdir()
    result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama), "--adapter", str(empty), "hello"])
    assert result.exit_code == 1
    assert "adapter_config.json is missing" in result.output
