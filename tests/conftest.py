"""Every test runs offline (transformers and PEFT must never reach for the hub), and the tiny
model and its adapters are built once per session for the serving and API tests.

Triton runs on CPU here through its interpreter, which must be switched on before anything imports
Triton: its standard library's functions are built when ``triton.language`` is first imported,
and built outside interpreter mode they cannot be called from an interpreted kernel. Set here, at
the root, so no test module that happens to run earlier (and imports a library that imports
Triton) can decide it for the kernel tests.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path

import pytest
from tiny_models import ADAPTER_SPECS, make_peft_adapter, make_tiny_llama


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
