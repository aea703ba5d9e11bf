"""Checks cheap enough to answer at `kubectl apply` time (kopf's validating webhook), so a bad manifest
fails in the user's terminal instead of turning Failed a minute later. The expensive checks (fetch,
digest, tensors) stay in the reconcile; these never touch the object store."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from loraplane.adapter_format.sources import under_prefix
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.api.loraadapter import SOURCE_SCHEMES, LoraAdapterSpec


def _pydantic_errors(err: ValidationError) -> list[str]:
    return [f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()]


@dataclass(frozen=True)
class ClusterPolicy:
    """What the cluster admin set for every namespace (``OperatorSettings.policy``), as it applies
    to one adapter's namespace: allow-lists (None: any) and, where tenants are bound to namespaces,
    the one tenant this namespace serves."""

    allowed_sources: list[str] | None = None
    allowed_endpoints: list[str] | None = None
    namespace_tenant: str | None = None


def tenancy_problems(
    spec: LoraAdapterSpec, base: BaseModelSpec, policy: ClusterPolicy = ClusterPolicy()
) -> list[tuple[str, str]]:
    """(reason, message) for each rule the adapter breaks: the cluster's ``policy`` and the
    BaseModel's tenant policy (which, where it lists tenants, decides instead of the namespace).
    The webhook refuses on them and the reconcile fails the adapter on them, webhook or not, before
    anything is fetched."""
    if policy.allowed_sources is not None and not any(under_prefix(spec.source.uri, p) for p in policy.allowed_sources):
        return [("SourceNotAllowed", "spec.source.uri: not under a source prefix this cluster's operator allows")]
    endpoint = (base.adapter_store.endpoint or "").rstrip("/")
    allowed_endpoints = policy.allowed_endpoints
    if allowed_endpoints is not None and endpoint and endpoint not in {e.rstrip("/") for e in allowed_endpoints}:
        # The operator itself fetches from this endpoint, from inside the cluster: a namespace user
        # must not turn it into a request to an internal service.
        message = f"spec.adapterStore.endpoint of BaseModel {spec.base_model!r} is not an endpoint this cluster allows"
        return [("EndpointNotAllowed", message)]
    tenants = base.tenancy.tenants
    if tenants is None:
        bound = policy.namespace_tenant
        if bound is not None and spec.tenant != bound:
            return [("TenantNotAllowed", f"spec.tenant: adapters in namespace {bound!r} serve tenant {bound!r} here")]
        return []
    tenant = next((t for t in tenants if t.name == spec.tenant), None)
    if tenant is None:
        return [("TenantNotAllowed", f"spec.tenant: {spec.tenant!r} is not one of {spec.base_model}'s tenants")]
    if not any(under_prefix(spec.source.uri, prefix) for prefix in tenant.sources):
        allowed = ", ".join(tenant.sources)
        return [("SourceNotAllowed", f"spec.source.uri: tenant {spec.tenant!r}'s adapters must be under {allowed}")]
    return []


def served_name_problem(name: str, spec: LoraAdapterSpec, served_by: str | None) -> str | None:
    """``served_by``: the LoraAdapter holding this one's served name (handlers.served_name_holder)."""
    if served_by is not None and served_by != name:
        return f"spec.servedName: {spec.served_name or name!r} is already served by LoraAdapter {served_by!r}"
    return None


def review_adapter(
    spec_raw: Mapping[str, Any],
    base_spec_raw: Mapping[str, Any] | None,
    allowed_schemes: tuple[str, ...] = SOURCE_SCHEMES,
    *,
    name: str = "",
    served_by: str | None = None,
    policy: ClusterPolicy = ClusterPolicy(),
) -> list[str]:
    """Reasons to refuse the LoraAdapter ``name`` (empty: admit). ``base_spec_raw`` is the
    referenced BaseModel's spec, None when it does not exist; ``served_by`` as for
    :func:`served_name_problem`."""
    try:
        spec = LoraAdapterSpec.model_validate(dict(spec_raw))
    except ValidationError as err:
        return _pydantic_errors(err)
    problems = []
    scheme = spec.source.uri.split("://", 1)[0]
    if scheme not in allowed_schemes:
        problems.append(f"spec.source.uri: scheme {scheme!r} is not allowed here (allowed: {', '.join(allowed_schemes)})")
    if base_spec_raw is None:
        problems.append(f"spec.baseModel: BaseModel {spec.base_model!r} does not exist in this namespace")
        return problems
    base = BaseModelSpec.model_validate(dict(base_spec_raw))
    problems += [message for _, message in tenancy_problems(spec, base, policy)]
    if (taken := served_name_problem(name, spec, served_by)) is not None:
        problems.append(taken)
    cap = base.engine.max_lora_rank
    if spec.rank is not None and spec.rank > cap and spec.rank_policy == "Reject":
        problems.append(
            f"spec.rank: {spec.rank} is above {spec.base_model}'s maxLoraRank {cap}; retrain, or set rankPolicy: Truncate"
        )
    return problems


def sets_spec(operation: str | None, old: Mapping[str, Any] | None, spec: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
    """Whether a write is the webhook's to review: a create, or an update that changes the spec of
    an object not being deleted. Anything else (the finalizer's removal, labels, annotations) must
    pass whatever the cluster holds now: an adapter whose BaseModel is gone, whose source a
    tightened allow-list refuses, or whose served name another claims, is still deletable."""
    if operation == "CREATE":
        return True
    if operation != "UPDATE" or meta.get("deletionTimestamp"):
        return False
    return old is None or dict(old.get("spec") or {}) != dict(spec)


def review_base(spec_raw: Mapping[str, Any]) -> list[str]:
    try:
        BaseModelSpec.model_validate(dict(spec_raw))
    except ValidationError as err:
        return _pydantic_errors(err)
    return []
