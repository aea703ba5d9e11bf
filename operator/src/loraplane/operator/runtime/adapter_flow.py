"""One LoraAdapter from manifest to Ready: validate → register with every ready replica of its base →
stage into host memory → pin when asked → Ready. Each step is a condition with a reason; a failure
is a reason on this adapter alone.

A change of ``spec.source`` is a promotion: the new version is validated while the old one keeps
serving; a version that fails validation leaves the old one serving with ``Promoted=False``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from loraplane.adapter_format import AdapterValidationError, check_adapter_name
from loraplane.adapter_format.sources import S3Settings
from loraplane.admin_api import AdminClient, LoadLoraRequest, ReplicaError, Tier, VerifyRequest
from loraplane.admin_api import Quotas as ReplicaQuotas
from loraplane.operator.api.basemodel import BaseModelSpec
from loraplane.operator.api.common import Quotas
from loraplane.operator.api.loraadapter import AdapterSource, LoraAdapterSpec, LoraAdapterStatus, ReplicaPlacement
from loraplane.operator.runtime import cluster
from loraplane.operator.runtime.adapter_check import DEFERRED_REASONS, CheckDeferred, CheckFailed, check_adapter_off_loop
from loraplane.operator.runtime.admission import tenancy_problems
from loraplane.operator.runtime.conditions import Status, condition, set_condition
from loraplane.operator.runtime.readiness_gate import open_after_staging
from loraplane.operator.runtime.replica_proof import only_proven
from loraplane.operator.runtime.settings import OperatorSettings

# Conditions that mean "not yet": the handler is retried (kopf.TemporaryError) until they clear.
WAITING_REASONS = frozenset(
    {"BaseModelNotFound", "NoReadyReplicas", "ReplicaError", "ServedNameTaken", "FetchTimeout", *DEFERRED_REASONS}
)


def waits(status: str | None, reason: str | None) -> bool:
    """Whether a condition says its adapter waits on something (and is retried until it clears)."""
    return status != "True" and reason in WAITING_REASONS


def unfinished(obj: Mapping[str, Any]) -> bool:
    """Whether a LoraAdapter's reconcile has more to do: its status does not speak for its
    generation (no write of the outcome landed), or it still waits on something."""
    status = obj.get("status") or {}
    current = status.get("observedGeneration") == obj["metadata"].get("generation")
    return not current or any(waits(c.get("status"), c.get("reason")) for c in status.get("conditions", []))


# A replica answers these the same way however often it is asked (a body or adapter it refuses).
PERMANENT_REPLICA_STATUSES = frozenset({400, 413, 422})


def parse_status(raw: Mapping[str, Any] | None) -> LoraAdapterStatus:
    """Our fields of the stored status; anything else there (another tool's) is ignored."""
    known = {f.alias or name for name, f in LoraAdapterStatus.model_fields.items()}
    return LoraAdapterStatus.model_validate({k: v for k, v in (raw or {}).items() if k in known})


@dataclass
class Outcome:
    """What a reconcile decided: the status to write and the Events to post."""

    status: LoraAdapterStatus
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)

    def condition(self, type_: str, status: Status, reason: str, message: str, generation: int | None) -> None:
        before = next((c for c in self.status.conditions if c.type == type_), None)
        self.status.conditions = set_condition(self.status.conditions, type_, status, reason, message, generation)
        if before is None or (before.status, before.reason) != (status, reason):
            self.events.append(("Normal" if status == "True" else "Warning", reason, message))


async def s3_settings(namespace: str, base: BaseModelSpec) -> S3Settings:
    store = base.adapter_store
    access = secret = None
    if store.credentials_secret is not None:
        data = await cluster.read_secret(namespace, store.credentials_secret.name)
        access, secret = data.get("AWS_ACCESS_KEY_ID"), data.get("AWS_SECRET_ACCESS_KEY")
    return S3Settings(endpoint=store.endpoint, access_key=access, secret_key=secret, region=store.region)


def serving_source(spec: LoraAdapterSpec, status: LoraAdapterStatus) -> AdapterSource:
    """The version replicas must serve: the validated one in status, not what the spec asks for
    now (a refused promotion leaves the spec pointing at the version that was refused)."""
    if status.serving_uri is not None and status.serving_digest is not None:
        return AdapterSource(uri=status.serving_uri, digest=status.serving_digest)
    return spec.source


async def stage(
    client: AdminClient, served: str, spec: LoraAdapterSpec, source: AdapterSource, *, pinned: bool, quotas: Quotas | None
) -> tuple[str, str | None]:
    """Register ``source`` (with the adapter's quotas), prefetch, pin or unpin on one replica;
    returns the tier it reports and, when the replica refused the pin (409: its pins already
    take every slot but the one left for unpinned adapters), why. The adapter serves unpinned."""
    limits = ReplicaQuotas.model_validate(quotas.model_dump(exclude_none=True)) if quotas is not None else None
    req = LoadLoraRequest(
        lora_name=served, lora_path=source.uri, digest=source.digest, tenant=spec.tenant,
        allow_rank_truncation=spec.rank_policy == "Truncate", quotas=limits,
    )  # fmt: skip
    await client.register(req)
    if spec.prefetch or pinned:
        await client.action(served, "prefetch")
    try:
        state = await client.action(served, "pin" if pinned else "unpin")
    except ReplicaError as err:
        if not (pinned and err.status == 409):
            raise
        now = await client.state(served)
        return (now.tier if now is not None else Tier.COLD).value, str(err)
    return state.tier.value, None


async def quality_gate(client: AdminClient, spec: LoraAdapterSpec) -> str:
    """Replay the version's golden outputs on a serving replica when the spec asks for it; a short
    note for the Validated condition, or CheckFailed with the drift."""
    gate = spec.quality_gate
    if gate is None:
        return ""
    try:
        report = await client.verify(VerifyRequest(
            lora_path=spec.source.uri, digest=spec.source.digest, allow_rank_truncation=spec.rank_policy == "Truncate",
            min_token_agreement=gate.min_token_agreement, max_mean_kl=gate.max_mean_kl,
        ))  # fmt: skip
    except ReplicaError as err:
        if err.status in (400, 422):
            raise CheckFailed("QualityGateFailed" if err.status == 422 else "GoldenOutputsMissing", str(err)) from None
        raise
    note = f"; golden outputs agree on {100 * report.token_agreement:.1f}% of tokens"
    return note + (f", KL {report.mean_kl:.3f}" if report.mean_kl is not None else "")


async def proven_replicas(namespace: str, base: str, token: str | None) -> list[cluster.Replica]:
    """The ready serving pods of ``base`` that hold its admin token (``replica_proof``)."""
    if token is None:
        # No Secret yet (the BaseModel's handler creates it before the Deployment): a real replica
        # cannot have started without it, so any Ready pod with the labels now is not one.
        return []
    return await only_proven(await cluster.ready_replicas(namespace, base), lambda r: AdminClient(r.url, token).proven())


async def reconcile(
    name: str, namespace: str, generation: int | None, spec_raw: Mapping[str, Any], status_raw: Mapping[str, Any] | None,
    settings: OperatorSettings, *, served_by: str | None = None,
) -> Outcome:  # fmt: skip
    """``served_by``: the LoraAdapter that holds this one's served name (itself, or None, when free)."""
    spec = LoraAdapterSpec.model_validate(dict(spec_raw))
    out = Outcome(parse_status(status_raw))
    out.status.observed_generation = generation
    base_obj = await cluster.get_custom(namespace, "basemodels", spec.base_model)
    if base_obj is None:
        out.status.phase = "Pending" if out.status.serving_digest is None else out.status.phase
        out.condition(
            "Ready", "False", "BaseModelNotFound", f"BaseModel {spec.base_model!r} does not exist in {namespace}", generation
        )
        return out
    base = BaseModelSpec.model_validate(base_obj["spec"])
    if served_by is not None and served_by != name:
        served = spec.served_name or name
        message = f"{served!r} is served by LoraAdapter {served_by!r}; this one waits until it is free"
        out.status.phase = "Pending" if out.status.serving_digest is None else out.status.phase
        out.condition("Ready", "False", "ServedNameTaken", message, generation)
        return out
    try:
        check_adapter_name(spec.served_name or name)  # what replicas accept, before one is asked
    except AdapterValidationError as err:
        out.status.phase = "Failed" if out.status.serving_digest is None else out.status.phase
        out.condition("Validated", "False", err.code.value, f"the served name: {err.message}", generation)
        out.condition("Ready", "False", err.code.value, f"the served name: {err.message}", generation)
        return out
    serving = (out.status.serving_uri, out.status.serving_digest) == (spec.source.uri, spec.source.digest)
    if not serving and (
        refusals := tenancy_problems(spec, base, settings.policy(namespace))
    ):  # webhook or not; nothing is fetched
        reason, message = refusals[0]
        if out.status.serving_digest is None:
            out.status.phase = "Failed"
            out.condition("Validated", "False", reason, message, generation)
            out.condition("Ready", "False", reason, message, generation)
        else:  # the version serving stays; the change is refused
            out.condition("Promoted", "False", reason, f"{spec.source.digest} refused: {message}", generation)
        return out
    token = await cluster.admin_token(namespace, spec.base_model)
    replicas = await proven_replicas(namespace, spec.base_model, token)
    if not replicas:
        out.condition("Staged", "False", "NoReadyReplicas", f"no serving replica of {spec.base_model!r} is ready yet", generation)
        out.status.phase = "Pending" if out.status.serving_digest is None else out.status.phase
        return out
    clients = [AdminClient(r.url, token) for r in replicas]
    try:
        return await _reconcile_on(name, namespace, generation, spec, base, replicas, clients, out)
    except ReplicaError as err:
        if err.status in PERMANENT_REPLICA_STATUSES:
            return await _refused_by_replica(err, spec, name, base, clients, out, generation)
        out.condition("Staged", "False", "ReplicaError", str(err), generation)
        out.status.phase = "Staging" if out.status.serving_digest is None else out.status.phase
        return out


async def _refused_by_replica(
    err: ReplicaError, spec: LoraAdapterSpec, name: str, base: BaseModelSpec, clients: list[AdminClient], out: Outcome,
    generation: int | None,
) -> Outcome:  # fmt: skip
    """A replica refused the version for good (400, 413, 422: asking again gets the same answer).
    Retrying it every few seconds would be a loop, so the adapter ends with the replica's reason.
    Replicas that took it already give it back: a new adapter leaves them all, and a promotion
    re-registers the version that was serving (best effort; the next sync restores the rest)."""
    served, message = spec.served_name or name, f"{err} (HTTP {err.status})"
    status = out.status
    if status.serving_digest is None:
        await asyncio.gather(*(c.unregister(served) for c in clients), return_exceptions=True)
        status.phase = "Failed"
        out.condition("Staged", "False", "ReplicaRefused", message, generation)
        out.condition("Ready", "False", "ReplicaRefused", message, generation)
        return out
    old = serving_source(spec, status)
    quotas = spec.quotas or base.tenancy.default_quotas
    await asyncio.gather(
        *(stage(c, served, spec, old, pinned=spec.pinned, quotas=quotas) for c in clients), return_exceptions=True
    )
    status.promoting_digest = None
    out.condition("Promoted", "False", "ReplicaRefused", f"{spec.source.digest} refused, {old.digest} keeps serving: {message}",
                  generation)  # fmt: skip
    return out


async def _reconcile_on(
    name: str, namespace: str, generation: int | None, spec: LoraAdapterSpec, base: BaseModelSpec,
    replicas: list[cluster.Replica], clients: list[AdminClient], out: Outcome,
) -> Outcome:  # fmt: skip
    """One adapter on its base's replicas: validate the version, stage or promote it, and fill
    the status. One function on purpose: its steps are the promotion protocol, and their order (a
    version is checked before any replica is asked to stage it, and the status names it as serving
    only once every replica has it) is read top to bottom."""
    status = out.status
    digest = spec.source.digest
    # A version is its URI and its digest: the same digest at a new URI is still a new version
    # (the files there may not hash to it), so it is validated again before anyone serves it.
    changed = (status.serving_uri, status.serving_digest) != (spec.source.uri, digest)
    promoting = status.serving_digest is not None and changed
    if promoting and status.promoting_digest != digest:
        # Shown while the new version is fetched, checked and staged (seconds to minutes for a large
        # adapter), while servingDigest still names the version taking requests: one extra write
        # per promotion, none for a new adapter or a resync.
        status.promoting_digest = digest
        await cluster.patch_status(namespace, "loraadapters", name, {"promotingDigest": digest})
    if changed:
        shape = await clients[0].base()
        s3 = await s3_settings(namespace, base)
        try:
            manifest = await check_adapter_off_loop(spec, shape, base.engine, s3)
            gate = await quality_gate(clients[0], spec)
        except TimeoutError:  # the store is slow or hanging: try again later, nothing changed
            message = f"{spec.source.uri} was not fetched and checked in time; retrying"
            out.condition("Validated", "False", "FetchTimeout", message, generation)
            return out
        except CheckDeferred as err:  # the operator's own trouble: try again later, nothing changed
            out.condition("Validated", "False", err.reason, err.message, generation)
            return out
        except CheckFailed as err:
            if promoting:
                status.promoting_digest = None
                out.condition(
                    "Promoted",
                    "False",
                    err.reason,
                    f"{digest} refused, {status.serving_digest} keeps serving: {err.message}",
                    generation,
                )
            else:
                status.phase = "Failed"
                out.condition("Validated", "False", err.reason, err.message, generation)
                out.condition("Ready", "False", err.reason, err.message, generation)
            return out
        checked = f"rank {manifest.rank}, {len(manifest.target_modules)} target modules{gate}"
        if manifest.digest_scope == "weights":  # the earlier form: say what to declare instead
            checked += f"; the declared digest covers the weights only, declare {manifest.adapter_digest} to cover all"
        out.condition("Validated", "True", "Valid", checked, generation)
        status.rank, status.size_bytes, status.adapter_digest = manifest.rank, manifest.size_bytes, manifest.adapter_digest
    served = spec.served_name or name
    pinned = spec.pinned
    quotas = spec.quotas or base.tenancy.default_quotas
    # Every replica's answer before any is acted on: a refusal from one must not leave another's
    # stage in flight, which would register the version after the refusal's clean-up had left.
    answers = await asyncio.gather(
        *(stage(c, served, spec, spec.source, pinned=pinned, quotas=quotas) for c in clients), return_exceptions=True
    )
    if failed := next((a for a in answers if isinstance(a, BaseException)), None):
        raise failed
    staged = [a for a in answers if not isinstance(a, BaseException)]
    status.replicas = [ReplicaPlacement(replica=r.name, tier=t) for r, (t, _) in zip(replicas, staged, strict=True)]  # type: ignore[arg-type]
    pin_refusals = [why for _, why in staged if why is not None]
    status.pinned = pinned and not pin_refusals
    if pin_refusals:
        out.condition("Pinned", "False", "PinLimitReached", pin_refusals[0], generation)
    elif pinned or condition(status.conditions, "Pinned") is not None:
        out.condition("Pinned", "True" if pinned else "False", "Pinned" if pinned else "NotRequested", "", generation)
    await open_after_staging(namespace, spec.base_model, served, replicas, clients)
    status.serving_uri, status.serving_digest, status.promoting_digest = spec.source.uri, digest, None
    status.phase = "Ready"
    out.condition("Staged", "True", "Staged", f"registered on {len(replicas)} replicas", generation)
    if promoting:
        out.condition("Promoted", "True", "Promoted", f"now serving {digest}", generation)
    elif (refused := next((c for c in status.conditions if c.type == "Promoted"), None)) and refused.status == "False":
        # The spec names the serving version again (a refused version reverted in git): the refusal is history.
        out.condition("Promoted", "True", "Reverted", f"the spec names {digest} again, which is serving", generation)
    out.condition("Ready", "True", "Serving", f"served as {served!r}", generation)
    return out


async def unregister_everywhere(name: str, namespace: str, spec_raw: Mapping[str, Any], settings: OperatorSettings) -> None:
    """Remove the adapter from every ready replica of its base (before the finalizer goes)."""
    spec = LoraAdapterSpec.model_validate(dict(spec_raw))
    served = spec.served_name or name
    token = await cluster.admin_token(namespace, spec.base_model)
    clients = [AdminClient(r.url, token) for r in await proven_replicas(namespace, spec.base_model, token)]
    try:
        await asyncio.gather(*(c.unregister(served) for c in clients))
    except ReplicaError as err:
        raise kopf.TemporaryError(f"unregistering {served}: {err}", delay=settings.retry_delay) from None
