"""Every test runs offline (transformers and PEFT must never reach for the hub), and the tiny
model and its adapters are built once per session for the serving and API tests."""

import os
from pathlib import Path

import pytest
from tiny_models import ADAPTER_SPECS, make_peft_adapter, make_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), rope_scaling=None)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        name: make_peft_adapter(tiny_llama, root / name, r, a, t, rs, seed=i + 1)
        for i, (name, (r, a, t, rs)) in enumerate(ADAPTER_SPECS.items())
    }
