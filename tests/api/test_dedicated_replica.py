"""A dedicated deployment's replica as its clients and the operator see it: the adapter merged at
start into the model it serves, under the adapter's served name, to the adapter's tenant alone,
billed as the adapter, and counted as the adapter's traffic in ``/admin/stats``."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from engine_helpers import engine_greedy, tiny_engine

from loraplane.adapter_format import adapter_digest
from loraplane.admin_api import ReplicaStats
from loraplane.serving.api.app import create_app
from loraplane.serving.config import EngineConfig
from loraplane.serving.http.loopback import serve_app
from loraplane.serving.http.tenants import TenantConfig, Tenants
from loraplane.usage import Metering

ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def dedicated(tiny_llama: Path, tiny_adapters: dict[str, Path], tmp_path_factory) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("dedicated")
    adapter = tiny_adapters["all8"]
    tenants = Tenants([TenantConfig(name="acme", api_keys=["key-acme"]), TenantConfig(name="globex", api_keys=["key-globex"])])

    def make():  # type: ignore[no-untyped-def]
        return tiny_engine(
            tiny_llama, root / "cache", max_model_len=256, merged_lora=str(adapter), merged_lora_digest=adapter_digest(adapter),
            merged_lora_tenant="acme", served_model_name="acme-bot", merged_lora_quotas={"tokens_per_minute": 400},
        )  # fmt: skip

    app = create_app(make, tenants=tenants, admin_token=ADMIN, metering=Metering.create("pod-d", root / "usage"))
    with serve_app(app) as url:
        yield url, root, adapter


def test_it_answers_as_the_adapter_does_on_the_shared_base(dedicated, tiny_llama: Path, tmp_path: Path) -> None:
    url, root, adapter = dedicated
    acme = openai.OpenAI(base_url=f"{url}/v1", api_key="key-acme", max_retries=0)
    assert [m.id for m in acme.models.list().data] == ["acme-bot"]
    prompts = [random.Random(i).choices(range(3, 320), k=9) for i in range(3)]
    got = [acme.completions.create(model="acme-bot", prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts]
    shared = tiny_engine(tiny_llama, tmp_path / "shared", {"acme-bot": adapter})
    want, _ = engine_greedy(shared, [(p, "acme-bot") for p in prompts], 8)
    assert got == [shared.tokenizer.decode(ids) for ids in want]
    # Merged once per pod disk: the folder is there, named by the base and the adapter's weights.
    (merged,) = (root / "cache" / "merged").iterdir()
    assert json.loads((merged / "merged_from.json").read_text())["adapter"]["digest"] == adapter_digest(adapter)


def test_another_tenant_finds_no_such_model(dedicated, tiny_llama: Path) -> None:
    url, _, _ = dedicated
    globex = openai.OpenAI(base_url=f"{url}/v1", api_key="key-globex", max_retries=0)
    assert globex.models.list().data == []
    for model in ("acme-bot", tiny_llama.name):  # nor does the base's name reach it
        with pytest.raises(openai.NotFoundError):
            globex.completions.create(model=model, prompt="hi", max_tokens=2)


def test_it_is_billed_and_counted_as_the_adapter(dedicated) -> None:
    url, root, adapter = dedicated
    acme = openai.OpenAI(base_url=f"{url}/v1", api_key="key-acme", max_retries=0)
    before = ReplicaStats.model_validate(httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json())
    acme.completions.create(model="acme-bot", prompt="hello there", max_tokens=3, user="u1")
    stats = ReplicaStats.model_validate(httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json())
    assert stats.dedicated_model == "acme-bot"
    entry = stats.adapters["acme-bot"]
    assert entry.tenant == "acme" and entry.digest == adapter_digest(adapter)
    assert entry.requests == before.adapters["acme-bot"].requests + 1
    records = [json.loads(line) for p in (root / "usage").glob("*.jsonl*") for line in p.read_text().splitlines()]
    assert records and all(r["tenant"] == "acme" and r["adapter"] == "acme-bot" for r in records)


def test_the_adapters_quotas_hold_on_its_dedicated_replica(dedicated) -> None:
    """Its LoraAdapter's quotas, as on the shared replicas: a 429 once the minute's tokens are
    spent, and in ``/admin/stats`` for the router to enforce at its edge too."""
    url, _, _ = dedicated
    stats = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert stats["adapters"]["acme-bot"]["quotas"] == {"max_concurrent": None, "tokens_per_minute": 400}
    acme = openai.OpenAI(base_url=f"{url}/v1", api_key="key-acme", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        for _ in range(8):  # at most 8 x ~100 tokens against 400 a minute
            acme.completions.create(model="acme-bot", prompt="count", max_tokens=96, extra_body={"ignore_eos": True})


def test_a_merged_lora_needs_its_served_name() -> None:
    with pytest.raises(ValueError, match="needs served_model_name"):
        EngineConfig(merged_lora="/a", merged_lora_digest=None)
