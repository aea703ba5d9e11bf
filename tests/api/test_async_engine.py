"""The server's engine loop (``AsyncEngine``): a request that arrives while a step of another
tenant's is running is taken in between that step's layers, and its first token reaches its
handler before that step ends."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from engine_helpers import tiny_engine

from loraplane.serving.engine.async_engine import AsyncEngine
from loraplane.serving.engine.sampling_params import SamplingParams


def test_a_neighbours_first_token_arrives_while_the_bursters_step_is_still_running(tiny_llama: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama, tmp_path, max_num_seqs=2)
    in_step = threading.Event()  # the engine thread is inside a decode step of tenant a's
    posted = threading.Event()  # b's request has been handed to the engine loop
    b_seen = threading.Event()  # b's handler has its first token
    seen_inside: list[bool] = []
    served = AsyncEngine(engine)
    hook = engine.between_layers
    assert hook is not None  # the engine loop takes arrivals between a step's layers

    def held() -> None:
        running = engine.scheduler.running
        if not posted.is_set() and len(running) == 2 and all(s.output_token_ids for s in running):
            in_step.set()  # a decode step of a's: hold it here until b's request is posted
            assert posted.wait(10)
        assert hook is not None
        hook()
        if engine.num_interjections and not seen_inside:
            seen_inside.append(b_seen.wait(10))  # the step stays in flight until b has its token

    engine.between_layers = held

    async def first_token(request_id: str, tenant: str, max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        tokens: list[int] = []
        async for out in served.generate([5, 6, 7, 8, 9], params, None, request_id, tenant):
            tokens = out.token_ids
            if tenant == "b":
                b_seen.set()
        return tokens

    async def scenario() -> list[list[int]]:
        bursts = [asyncio.create_task(first_token(f"a{i}", "a", 24)) for i in range(3)]
        assert await asyncio.to_thread(in_step.wait, 10)
        steady = asyncio.create_task(first_token("b0", "b", 2))
        while served._arrivals.empty():  # until b's generate has posted its request
            await asyncio.sleep(0.01)
        posted.set()
        return await asyncio.gather(*bursts, steady)

    try:
        results = asyncio.run(scenario())
    finally:
        served.shutdown()
    assert seen_inside == [True]
    assert [len(r) for r in results] == [24, 24, 24, 2]
    assert engine.num_interjections == 1
