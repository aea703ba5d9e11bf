"""Replay requests against a server with the official ``openai`` client, streaming, and time every token.

Time to first token runs from the request's scheduled arrival (not from when the client got
round to sending it), so a client that falls behind shows up as latency rather than hiding it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import openai
from tqdm import tqdm

from loraplane.serving.bench.workload import BenchRequest


@dataclass
class Outcome:
    request: BenchRequest
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    status: int | None = None  # HTTP status of a refused request
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive streamed tokens (chunks), seconds."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


async def _one(client: openai.AsyncOpenAI, req: BenchRequest, start: float) -> Outcome:
    out = Outcome(req)
    await asyncio.sleep(max(0.0, start + req.at - time.monotonic()))
    arrival = start + req.at
    common = {"model": req.model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True}
    options = {"include_usage": True}
    try:
        if req.chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": req.prompt}],
                stream_options=options,
                **common,  # type: ignore[call-overload]
            )
        else:
            stream = await client.completions.create(
                prompt=req.prompt,
                stream_options=options,
                extra_body={"ignore_eos": True},
                **common,  # type: ignore[call-overload]
            )
        async for chunk in stream:
            text = ""
            if chunk.choices:
                c = chunk.choices[0]
                text = (c.delta.content or "") if req.chat else c.text
            if text:
                now = time.monotonic()
                out.ttft = out.ttft if out.ttft is not None else now - arrival
                out.token_times.append(now)
                out.text += text
            if chunk.usage is not None:
                out.prompt_tokens, out.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
    except openai.APIStatusError as err:
        out.status, out.error = err.status_code, err.message
    except openai.APIError as err:  # connection lost, stream cut: a failure, reported as such
        out.error = f"{type(err).__name__}: {err}"
    return out


async def replay(
    url: str, requests: Sequence[BenchRequest], keys: Mapping[str | None, str], *, progress: bool = True, timeout: float = 600
) -> tuple[list[Outcome], float]:
    """Send every request at its time, as its tenant; returns the outcomes (in request order) and
    the wall time from the first arrival to the last answer."""
    clients = {
        tenant: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout)
        for tenant, key in keys.items()
    }
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, leave=False)
    start = time.monotonic() + 0.05

    async def tracked(req: BenchRequest) -> Outcome:
        result = await _one(clients[req.tenant], req, start)
        bar.update()
        return result

    try:
        outcomes = await asyncio.gather(*(tracked(r) for r in requests))
    finally:
        bar.close()
        for client in clients.values():
            await client.close()
    first = min((r.at for r in requests), default=0.0)
    return list(outcomes), time.monotonic() - start - first
