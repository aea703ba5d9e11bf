"""Adapter tiers on the real engine: S3 (moto server through minio) -> disk cache -> host -> device.

Covers cold loads, host and device hits, eviction order, pinning, a failed load that fails only
its own requests, validation failures arriving from S3, the disk cache surviving a restart, and
a cold load that does not hold up the decode steps of requests already running.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from broken_adapters import corrupt
from engine_helpers import engine_greedy, tiny_engine
from s3_server import ACCESS, SECRET, moto_server, upload_folder

from loraplane.adapter_format import ErrorCode, adapter_digest
from loraplane.admin_api import Tier
from loraplane.serving.api.admin.view import replica_stats
from loraplane.serving.engine.sampling_params import SamplingParams
from loraplane.serving.engine.sequence import FinishReason
from loraplane.serving.lora.entries import AdapterSpec, PinLimitReached

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def s3(tiny_adapters: dict[str, Path]):
    with moto_server() as endpoint:
        uris = {name: upload_folder(endpoint, "adapters", f"tenant-a/{name}", folder) for name, folder in tiny_adapters.items()}
        yield endpoint, uris


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, s3) -> None:
    endpoint, _ = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_REGION", "us-east-1")


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> dict[str, list[int]]:
    """Each adapter's greedy answer, loaded from its local folder."""
    engine = tiny_engine(tiny_llama, tmp_path_factory.mktemp("ref"), tiny_adapters)
    return {name: engine_greedy(engine, [(PROMPT, name)], 6)[0][0] for name in tiny_adapters}


def run(engine, adapter: str | None, max_tokens: int = 6):
    return engine.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), [adapter])[0]


def test_cold_host_and_device_hits(env, s3, tiny_llama, reference, tmp_path) -> None:
    _, uris = s3
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=1, max_cpu_loras=2)
    for name in ("qv4", "all8"):
        engine.register_lora(AdapterSpec(name, uris[name], tenant="tenant-a"))
    assert engine.adapters.residency("qv4") is Tier.COLD
    assert run(engine, "qv4").token_ids == reference["qv4"]  # cold: fetched from S3, validated, placed
    assert run(engine, "qv4").token_ids == reference["qv4"]  # device hit
    assert run(engine, "all8").token_ids == reference["all8"]  # cold; evicts qv4 from the only slot
    assert engine.adapters.residency("qv4") is Tier.HOST
    assert run(engine, "qv4").token_ids == reference["qv4"]  # host hit
    stats = replica_stats(engine).model_dump()["adapters"]
    assert (stats["qv4"]["cold_loads"], stats["qv4"]["device_hits"], stats["qv4"]["host_hits"]) == (1, 1, 1)
    assert stats["qv4"]["load_seconds"]["cold"]["count"] == 1
    assert stats["qv4"]["queue_wait_seconds"]["count"] == 2  # the cold and the host arrival waited
    assert replica_stats(engine).model_dump()["tenants"]["tenant-a"]["requests"] == 4


def test_eviction_order_follows_the_policy_and_spares_pinned(env, s3, tiny_llama, tmp_path) -> None:
    _, uris = s3
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2, max_cpu_loras=2)
    for name in ("qv4", "all8", "ku2"):
        engine.register_lora(AdapterSpec(name, uris[name]))
    run(engine, "qv4")
    run(engine, "all8")
    run(engine, "qv4")  # all8 is now least recently used
    run(engine, "ku2")
    assert engine.adapters.residency("all8") is Tier.COLD  # out of both tiers (LRU)
    assert engine.adapters.residency("qv4") is Tier.DEVICE
    engine.adapters.pin("ku2")
    run(engine, "all8")  # needs a slot: qv4 goes, pinned ku2 stays although older
    assert engine.adapters.residency("ku2") is Tier.DEVICE
    assert engine.adapters.residency("qv4") is Tier.COLD
    engine.adapters.unpin("ku2")
    run(engine, "qv4")
    assert engine.adapters.residency("ku2") is Tier.COLD


def test_a_failed_load_fails_only_its_own_requests(env, s3, tiny_llama, reference, tmp_path) -> None:
    _, uris = s3
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2)
    engine.register_lora(AdapterSpec("qv4", uris["qv4"]))
    engine.register_lora(AdapterSpec("ghost", "s3://adapters/tenant-a/does-not-exist"))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = engine.generate([PROMPT, PROMPT, PROMPT, PROMPT], params, ["ghost", "qv4", None, "ghost"])
    assert [o.finish_reason for o in outs] == [FinishReason.ERROR, FinishReason.LENGTH, FinishReason.LENGTH, FinishReason.ERROR]
    assert "ghost" in outs[0].error and "missing" in outs[0].error
    assert outs[1].token_ids == reference["qv4"]
    assert engine.adapters.residency("ghost") is Tier.FAILED


@pytest.mark.parametrize(
    ("how", "code"),
    [("nan", ErrorCode.CORRUPT_SAFETENSORS), ("base", ErrorCode.BASE_MISMATCH), ("rank", ErrorCode.SHAPE_MISMATCH),
     ("pickle", ErrorCode.PICKLE_REFUSED), ("digest", ErrorCode.DIGEST_MISMATCH), ("missing", ErrorCode.MISSING_FILE),
     ("config", ErrorCode.BAD_CONFIG), ("target", ErrorCode.UNSUPPORTED_TARGET), ("layer", ErrorCode.SHAPE_MISMATCH),
     ("half", ErrorCode.SHAPE_MISMATCH), ("empty", ErrorCode.NO_MATCHING_TENSORS), ("large", ErrorCode.TOO_LARGE)],
)  # fmt: skip
def test_invalid_adapters_from_s3_fail_alone(env, s3, tiny_llama, tiny_adapters, reference, tmp_path, how, code) -> None:
    endpoint, uris = s3
    bad = corrupt(tiny_adapters["all8"], tmp_path / "bad", how)
    uri = upload_folder(endpoint, "adapters", f"broken/{how}", bad)
    # "large": a limit the small qv4 adapter meets and the rank-8 all-module one does not.
    limit = (tiny_adapters["qv4"] / "adapter_model.safetensors").stat().st_size if how == "large" else 2**30
    engine = tiny_engine(tiny_llama, tmp_path / "cache", max_loras=2, max_adapter_bytes=limit)
    digest = "sha256:" + "0" * 64 if how == "digest" else None
    engine.register_lora(AdapterSpec("bad", uri, digest=digest))
    engine.register_lora(AdapterSpec("qv4", uris["qv4"]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    bad_out, good_out = engine.generate([PROMPT, PROMPT], params, ["bad", "qv4"])
    assert bad_out.finish_reason is FinishReason.ERROR and str(code) in bad_out.error
    assert good_out.token_ids == reference["qv4"]


def test_disk_cache_survives_a_restart(env, s3, tiny_llama, tiny_adapters, reference, tmp_path, monkeypatch) -> None:
    _, uris = s3
    digest = adapter_digest(tiny_adapters["mlp16"])
    first = tiny_engine(tiny_llama, tmp_path, max_loras=1)
    first.register_lora(AdapterSpec("mlp16", uris["mlp16"], digest=digest))
    assert run(first, "mlp16").token_ids == reference["mlp16"]
    # A new process with the same cache dir and registration: no fetch at all.
    from loraplane.adapter_format import sources

    def no_network(self, into, bounds=None):
        raise AssertionError("fetched from S3 although the disk cache holds this digest")

    monkeypatch.setattr(sources.S3Source, "fetch", no_network)
    second = tiny_engine(tiny_llama, tmp_path, max_loras=1)
    second.register_lora(AdapterSpec("mlp16", uris["mlp16"], digest=digest))
    assert run(second, "mlp16").token_ids == reference["mlp16"]
    assert replica_stats(second).model_dump()["adapters"]["mlp16"]["load_seconds"].keys() >= {"disk"}


def test_a_corrupted_disk_cache_entry_is_fetched_again(env, s3, tiny_llama, tiny_adapters, reference, tmp_path) -> None:
    """Bit rot in the node cache costs one refetch, not a permanently failed adapter."""
    _, uris = s3
    digest = adapter_digest(tiny_adapters["mlp16"])
    first = tiny_engine(tiny_llama, tmp_path, max_loras=1)
    first.register_lora(AdapterSpec("mlp16", uris["mlp16"], digest=digest))
    assert run(first, "mlp16").token_ids == reference["mlp16"]
    (cached,) = (tmp_path / "adapters").glob("*/adapter_model.safetensors")
    data = bytearray(cached.read_bytes())
    data[-1] ^= 0xFF
    cached.write_bytes(bytes(data))
    second = tiny_engine(tiny_llama, tmp_path, max_loras=1)
    second.register_lora(AdapterSpec("mlp16", uris["mlp16"], digest=digest))
    out = run(second, "mlp16")
    assert out.finish_reason is not FinishReason.ERROR, out.error
    assert out.token_ids == reference["mlp16"]
    loads = replica_stats(second).model_dump()["adapters"]["mlp16"]["load_seconds"]
    assert "cold" in loads and "disk" not in loads


def test_a_cold_load_does_not_delay_running_decodes(tiny_llama, tiny_adapters, tmp_path, monkeypatch) -> None:
    """Counted in steps: while an adapter loads, every step still gives each running request a token."""
    import threading

    from loraplane.adapter_format import sources

    gate = threading.Event()
    real_fetch = sources.FileSource.fetch

    def slow_fetch(self, into, bounds=None):  # the load cannot finish until the test opens the gate
        gate.wait(timeout=30)
        real_fetch(self, into, bounds)

    monkeypatch.setattr(sources.FileSource, "fetch", slow_fetch)
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2)
    engine.register_lora(AdapterSpec("cold", str(tiny_adapters["all8"])))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    running = [engine.add_request([9, 10, 11 + i], params) for i in range(3)]
    engine.step()  # the three are prefilled and running
    cold = engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapter="cold")
    produced = {r: 1 for r in running}
    for _ in range(10):
        for out in engine.step():
            assert out.request_id != cold
            produced[out.request_id] = len(out.token_ids)
    assert all(n == 11 for n in produced.values()), produced  # one token per step, no stall
    assert engine.adapters.residency("cold") is Tier.LOADING
    gate.set()
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert done[cold].finish_reason is FinishReason.LENGTH


def test_same_weights_with_another_config_is_another_adapter(tiny_llama, tiny_adapters, tmp_path) -> None:
    """The disk cache keys on the whole content: equal weights under another lora_alpha must not
    reuse the first adapter's folder (and its scaling)."""
    louder = shutil.copytree(tiny_adapters["qv4"], tmp_path / "louder")
    config = json.loads((louder / "adapter_config.json").read_text())
    (louder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 4 * config["lora_alpha"]}))
    engine = tiny_engine(tiny_llama, tmp_path / "cache", max_loras=2)
    engine.register_lora(AdapterSpec("qv4", str(tiny_adapters["qv4"])))
    engine.register_lora(AdapterSpec("louder", str(louder)))
    run(engine, "qv4")
    run(engine, "louder")
    assert engine.adapters.info("qv4").folder != engine.adapters.info("louder").folder
    scaling = {name: engine.adapters.load_now(name).manifest.scaling for name in ("qv4", "louder")}  # both already in host memory
    assert scaling["louder"] == 4 * scaling["qv4"]


def test_concurrent_requests_share_one_load(env, s3, tiny_llama, reference, tmp_path) -> None:
    _, uris = s3
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2)
    engine.register_lora(AdapterSpec("ku2", uris["ku2"]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = engine.generate([PROMPT] * 5, params, ["ku2"] * 5)
    assert all(o.token_ids == reference["ku2"] for o in outs)
    assert replica_stats(engine).model_dump()["adapters"]["ku2"]["load_seconds"]["cold"]["count"] == 1


def test_pins_leave_a_device_slot_to_unpinned_adapters(tiny_llama, tiny_adapters, reference, tmp_path) -> None:
    """With every slot pinned, an unpinned adapter's requests would wait for ever: the pin that
    would take the last slot is refused and changes nothing."""
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2, max_cpu_loras=4)
    for name in ("qv4", "all8", "ku2"):
        engine.register_lora(AdapterSpec(name, str(tiny_adapters[name])))
    engine.pin_lora("qv4")
    engine.pin_lora("qv4")  # pinning again is not a second pin
    with pytest.raises(PinLimitReached, match="at most max_loras - 1 = 1"):
        engine.pin_lora("all8")
    assert not engine.adapters.info("all8").pinned
    assert run(engine, "qv4").token_ids == reference["qv4"]
    assert run(engine, "ku2").token_ids == reference["ku2"]  # the unpinned slot serves the others
    assert run(engine, "all8").token_ids == reference["all8"]
    engine.unpin_lora("qv4")
    engine.pin_lora("all8")  # room again


def test_prometheus_shows_each_adapters_tier_and_pin(tiny_llama, tiny_adapters, tmp_path) -> None:
    from prometheus_client import generate_latest

    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2)
    engine.register_lora(AdapterSpec("qv4", str(tiny_adapters["qv4"]), tenant="tenant-a"))
    engine.register_lora(AdapterSpec("ku2", str(tiny_adapters["ku2"]), tenant="tenant-b"))
    run(engine, "qv4")
    engine.pin_lora("qv4")
    text = generate_latest(engine.metrics.registry).decode()
    assert 'loraplane_adapter_tier{adapter="qv4",tenant="tenant-a",tier="device"} 1.0' in text
    assert 'loraplane_adapter_tier{adapter="ku2",tenant="tenant-b",tier="cold"} 1.0' in text
    assert 'loraplane_adapter_pinned{adapter="qv4",tenant="tenant-a"} 1.0' in text
    assert 'loraplane_requests_total{adapter="qv4",tenant="tenant-a"} 1.0' in text
    assert "loraplane_disk_cache_entries 1.0" in text  # qv4's files, copied into the cache by its load
    assert "loraplane_disk_cache_evictions_total 0.0" in text


@pytest.mark.parametrize("policy", ["demand", "lru"])
def test_a_busy_adapter_cannot_starve_one_waiting_for_its_slot(tiny_llama, tiny_adapters, tmp_path, monkeypatch, policy) -> None:
    """One device slot; adapter qv4 always has requests running and more arriving; all8 waits for
    the slot. The slot must drain (qv4's new requests hold back until its running ones finish) so
    all8 gets served, rather than waiting for as long as qv4's traffic lasts (the slot hold and
    the drain's preemption are counted in steps, so the defaults show within a few)."""
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=1, max_cpu_loras=2, eviction_policy=policy)
    for name in ("qv4", "all8"):
        engine.load_lora(name, str(tiny_adapters[name]))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(PROMPT, params, adapter="qv4")
    engine.step()
    waiting = engine.add_request(PROMPT, params, adapter="all8")
    finished_at, hot_done = None, 0
    for step in range(200):
        engine.add_request(PROMPT, params, adapter="qv4")  # qv4's traffic never pauses
        for out in engine.step():
            if out.finished and out.request_id == waiting:
                finished_at = step
            elif out.finished:
                hot_done += 1
        if finished_at is not None:
            break
    assert finished_at is not None and finished_at < 20, "all8 starved behind qv4's continuous traffic"
    assert hot_done > 0  # and qv4 kept being served meanwhile


def test_a_new_version_takes_new_requests_while_running_ones_finish_on_the_old(
    tiny_llama, tiny_adapters, reference, tmp_path
) -> None:
    """Promotion without failing a request: re-registering a name while it has a request running
    moves the old version aside; the running request ends exactly as the old version alone would
    have, the next request gets the new version, and the old one's slot frees when it is done."""
    engine = tiny_engine(tiny_llama, tmp_path, max_loras=2, max_cpu_loras=4)
    engine.load_lora("bot", str(tiny_adapters["qv4"]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    old = engine.add_request(PROMPT, params, adapter="bot")
    for _ in range(3):
        engine.step()
    engine.register_lora(AdapterSpec("bot", str(tiny_adapters["all8"])))  # no AdapterBusy
    new = engine.add_request(PROMPT, params, adapter="bot")
    done = {}
    while len(done) < 2:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done[old] == reference["qv4"] and done[new] == reference["all8"]
    assert engine.adapters.retired == {} and len(engine.adapters.device) == 1  # the old slot is free again
    # Removing a name with a request running lets that request finish too.
    running = engine.add_request(PROMPT, params, adapter="bot")
    engine.step()
    engine.unload_lora("bot")
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].token_ids == reference["all8"] and outs[0].request_id == running
    assert engine.adapters.retired == {} and len(engine.adapters.device) == 0
