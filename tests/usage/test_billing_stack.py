"""Billing that loses nothing, end to end: two `loraplane serve` replicas and the router as
processes, exporting to S3 (moto), steady traffic through the router with the official client,
one replica SIGKILLed and restarted mid-traffic, in the middle of a stream and while its spool is
being written. Afterwards the report holds every request the client saw complete exactly once,
with the tokens the client was told, and every request the router refused, once, as refused; the
stream the kill cut ended with an error its client saw, never as a clean finish."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from s3_server import ACCESS, SECRET, client, moto_server

from loraplane.adapter_format.sources import S3Settings
from loraplane.serving.bench.deployment import spawn_replicas, spawn_router
from loraplane.serving.config import EngineConfig
from loraplane.usage import UsageRecord
from loraplane.usage.report import build_report, iter_blobs

pytestmark = pytest.mark.slow


def test_sigkill_of_a_replica_loses_no_billed_request(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), dtype="float32", cache_dir=tmp_path / "cache", max_model_len=256,
                          block_size=4, num_kv_blocks=512, max_loras=2, max_lora_rank=16)  # fmt: skip
    with moto_server() as endpoint:
        client(endpoint).make_bucket("billing")
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET,
               "AWS_REGION": "us-east-1"}  # fmt: skip

        def usage_args(name: str) -> list[str]:
            return ["--usage-dir", str(tmp_path / f"usage-{name}"), "--usage-export", "s3://billing/usage",
                    "--usage-segment-age", "1", "--replica-name", name]  # fmt: skip

        completed: dict[str, tuple[int, int]] = {}  # response id -> (prompt, completion) tokens
        refusals = 0
        stop = threading.Event()
        adapters = {"bot": (tiny_adapters["qv4"], "acme")}
        replicas = spawn_replicas(config, adapters, ["acme", "metered"], 2, replica_args=lambda i: usage_args(f"pod-{i}"),
                                  env=env, quotas={"metered": {"tokens_per_minute": 60}})  # fmt: skip
        with replicas as fleet, spawn_router(fleet, extra_args=usage_args("router")) as router:

            def traffic(tenant: str, model: str) -> None:
                nonlocal refusals
                api = openai.OpenAI(base_url=f"{router}/v1", api_key=fleet.keys[tenant], max_retries=0, timeout=60)
                i = 0
                while not stop.is_set():
                    i += 1
                    try:
                        r = api.completions.create(model=model, prompt=f"request {i} from {tenant}", max_tokens=4 + i % 5)
                    except openai.RateLimitError:
                        refusals += 1
                        time.sleep(0.05)
                        continue
                    except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
                        continue  # cut by the SIGKILL: the client did not see it complete
                    assert r.usage is not None
                    completed[r.id] = (r.usage.prompt_tokens, r.usage.completion_tokens)

            mid_stream, cut = threading.Event(), []

            def streams() -> None:
                """Long streams straight to the replica that is killed, so one is cut."""
                api = openai.OpenAI(base_url=f"{fleet.urls[0]}/v1", api_key=fleet.keys["acme"], max_retries=0, timeout=60)
                while not stop.is_set():
                    chunks, usage, rid = 0, None, ""
                    try:
                        for chunk in api.completions.create(
                            model="bot", prompt="a long story", max_tokens=200, stream=True,
                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                        ):  # fmt: skip
                            rid, chunks, usage = chunk.id, chunks + 1, chunk.usage or usage
                            if chunks == 5:
                                mid_stream.set()
                    except (openai.APIError, httpx.HTTPError) as err:
                        cut.append((rid, chunks, repr(err)))
                        time.sleep(0.5)  # the replica is down: wait for it, as a client's retry would
                        continue
                    finally:
                        mid_stream.clear()
                    assert usage is not None and usage.completion_tokens == 200, (rid, chunks, usage)
                    completed[rid] = (usage.prompt_tokens, usage.completion_tokens)

            base = openai.OpenAI(base_url=f"{router}/v1", api_key=fleet.keys["acme"]).models.list().data[0].id
            workers = [threading.Thread(target=traffic, args=a) for a in (("acme", "bot"), ("acme", base), ("metered", base))]
            workers.append(threading.Thread(target=streams))
            for w in workers:
                w.start()
            time.sleep(3)
            assert mid_stream.wait(30)
            fleet.kill(0)
            time.sleep(1)
            fleet.start(0)
            fleet.ready(0)
            time.sleep(3)
            stop.set()
            for w in workers:
                w.join()
        # Both replicas and the router stopped gracefully: their last segments are exported.
        settings = S3Settings(endpoint, ACCESS, SECRET, "us-east-1")
        blobs = list(iter_blobs("s3://billing/usage", settings, None, None, progress=False))
    assert {name.split("/replica=")[1].split("/")[0] for name, _ in blobs} == {"pod-0", "pod-1", "router"}
    records = {}
    for _, data in blobs:
        for line in data.splitlines():
            r = UsageRecord.model_validate_json(line)
            assert r.request_id not in records, f"{r.request_id} recorded twice"
            records[r.request_id] = r
    assert len(completed) > 20 and refusals > 0
    # The stream in flight at the kill ended with an error part way, and was not billed as done.
    assert cut and 5 <= cut[0][1] < 200, cut
    assert cut[0][0] not in completed and (cut[0][0] not in records or records[cut[0][0]].outcome.value != "completed")
    for rid, (prompt, completion) in completed.items():
        r = records[rid]
        assert (r.prompt_tokens, r.completion_tokens, r.outcome.value) == (prompt, completion, "completed"), rid
    refused = [r for r in records.values() if r.outcome.value == "refused"]
    # Mostly refused at the edge; a replica, which counts the prompt exactly, may refuse one the
    # edge's estimate let through. Either way each refusal is one record.
    assert len(refused) == refusals and all(r.tenant == "metered" for r in refused)
    assert sum(1 for r in refused if r.source == "router") > 0
    report = build_report(blobs)
    assert report.duplicates == 0
    acme = sum(row.requests for row in report.rows if row.tenant == "acme")
    assert acme >= sum(1 for rid in completed if records[rid].tenant == "acme")
