"""OpenAI's ``/v1/models`` (list and retrieve), and which model a request names: the base or an
adapter the calling tenant may use. Another tenant's adapter answers exactly as a missing model."""

from __future__ import annotations

from fastapi import APIRouter

from loraplane.serving.api.deps import Caller, Engine
from loraplane.serving.engine.async_engine import AsyncEngine
from loraplane.serving.http.errors import APIError
from loraplane.serving.http.protocol.common import ModelCard, ModelList
from loraplane.serving.http.tenants import TenantConfig, Tenants

router = APIRouter()


def _missing(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def may_use_base(engine: AsyncEngine, tenant: TenantConfig | None) -> bool:
    """The base is open to tenants allowed it; a dedicated replica's model (an adapter merged into
    the base) to its adapter's tenant alone, as the adapter is on the shared replicas."""
    if engine.engine.base.merged:
        return Tenants.may_use(tenant, engine.engine.config.merged_lora_tenant)
    return tenant is None or tenant.allow_base


def cards(engine: AsyncEngine, tenant: TenantConfig | None) -> list[ModelCard]:
    """The base (for a tenant allowed it) and the adapters the caller may use, each with the
    source it is served from as ``root`` (vLLM's field)."""
    base, context = engine.engine.base.shape.name, engine.engine.max_model_len
    found = [ModelCard(id=base, root=engine.engine.config.model, max_model_len=context)] if may_use_base(engine, tenant) else []
    for name, spec in sorted(engine.engine.adapters.catalog.items()):  # the engine thread's published snapshot
        if Tenants.may_use(tenant, spec.tenant):
            found.append(ModelCard(id=name, root=spec.source, parent=base, max_model_len=context))
    return found


def resolve_model(engine: AsyncEngine, model: str, tenant: TenantConfig | None) -> str | None:
    """The adapter to use (None for the base). Another tenant's adapter, or the base for a
    tenant without base access, answers exactly as a missing model."""
    if model == engine.engine.base.shape.name and may_use_base(engine, tenant):
        return None
    spec = engine.engine.adapters.catalog.get(model)
    if spec is not None and Tenants.may_use(tenant, spec.tenant):
        return model
    raise _missing(model)


@router.get("/v1/models")
async def models(engine: Engine, tenant: Caller) -> ModelList:
    return ModelList(data=cards(engine, tenant))


@router.get("/v1/models/{model:path}")
async def model(model: str, engine: Engine, tenant: Caller) -> ModelCard:
    """One card, as OpenAI's API retrieves it; another tenant's adapter is as missing as none."""
    for card in cards(engine, tenant):
        if card.id == model:
            return card
    raise _missing(model)
