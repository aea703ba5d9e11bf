"""Drive the engine the way the reference is driven: greedy, EOS suppressed, logits captured."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loraplane.serving.config import EngineConfig
from loraplane.serving.engine.builder import build_engine
from loraplane.serving.engine.llm_engine import LLMEngine
from loraplane.serving.engine.sampling_params import SamplingParams


class Built:
    """An app's engine factory that keeps what it built: the test's own handle on the engine the
    server runs, instead of a path through the app's private state."""

    def __init__(self, make: Callable[[], LLMEngine]) -> None:
        self.make = make
        self.engine: LLMEngine | None = None

    def __call__(self) -> LLMEngine:
        self.engine = self.make()
        return self.engine

    def get(self) -> LLMEngine:
        assert self.engine is not None, "the server has not built its engine yet"
        return self.engine


class LogitsRecorder:
    """A logits processor that keeps a copy of every raw logits row it sees, then suppresses EOS
    (what transformers' ``min_new_tokens`` does), so both sides pick from the same candidates."""

    def __init__(self, eos_id: int | None) -> None:
        self.rows: list[torch.Tensor] = []
        self.eos_id = eos_id

    def __call__(self, _tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.rows.append(logits.clone())
        if self.eos_id is None:
            return logits
        out = logits.clone()
        out[self.eos_id] = float("-inf")
        return out

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.rows)


def tiny_engine(base: Path, cache: Path, adapters: dict[str, Path] | None = None, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {
        "model": str(base),
        "dtype": "float32",  # compared with transformers in fp32
        "cache_dir": cache,
        "max_loras": 4,
        "max_lora_rank": 16,
        "block_size": 4,
        "num_kv_blocks": 256,
        "lora_modules": {k: str(v) for k, v in (adapters or {}).items()},
    }
    settings.update(overrides)
    return build_engine(EngineConfig(**settings))  # type: ignore[arg-type]


def engine_greedy(
    engine: LLMEngine, requests: list[tuple[list[int], str | None]], steps: int, eos_id: int | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorders = [LogitsRecorder(eos_id) for _ in requests]
    params = [SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logits_processors=[r]) for r in recorders]
    outs = engine.generate([p for p, _ in requests], params, [a for _, a in requests])
    return [o.token_ids for o in outs], [r.stacked() for r in recorders]


def metered_app(base: Path, adapters: dict[str, Path], root: Path, max_model_len: int = 256) -> tuple[Any, Path]:
    """An API app on the tiny engine with ``adapters``, spooling its usage records under
    ``root / "usage"`` (returned beside it) so that a test can read what it billed."""
    from loraplane.serving.api.app import create_app
    from loraplane.usage import Metering

    usage = root / "usage"
    metering = Metering.create("test", usage, fsync_interval=0.05)
    return create_app(lambda: tiny_engine(base, root / "cache", adapters, max_model_len=max_model_len), metering=metering), usage
