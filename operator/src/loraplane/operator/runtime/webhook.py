"""The validating webhook (`loraplane operator --webhook-port`): kopf serves it and keeps the
ValidatingWebhookConfiguration in step. A separate module because kopf refuses to start with
admission handlers but no webhook server, and a cluster without cert plumbing runs without it.

The webhook is early feedback, never the only guard (the reconcile checks the same rules and says
why in conditions), so it must never stand in a user's way where it cannot help: it sees creates
and updates only, passes any write that leaves the spec as it was (a deletion's finalizer removal,
labels, an adapter whose BaseModel is gone or whose source a tightened policy now refuses), and
fails open (``failurePolicy: Ignore``): the configuration outlives a SIGKILLed operator, and a
fail-closed one would then refuse every write to these kinds until someone deleted it by hand."""

from __future__ import annotations

from typing import Any

import kopf

from loraplane.operator.api import GROUP, VERSION
from loraplane.operator.runtime import cluster
from loraplane.operator.runtime.admission import review_adapter, review_base, sets_spec
from loraplane.operator.runtime.handlers import SETTINGS, served_name_holder
from loraplane.operator.runtime.webhook_tls import WebhookServer


@kopf.on.startup()
def serve_webhook(settings: kopf.OperatorSettings, **_: Any) -> None:
    if SETTINGS.webhook_port is None:
        raise kopf.PermanentError("the webhook module was loaded without LORAPLANE_WEBHOOK_PORT")
    if SETTINGS.webhook_service is not None:
        namespace, name = SETTINGS.webhook_service.split("/")
        settings.admission.server = WebhookServer(port=SETTINGS.webhook_port, service=(namespace, name))
    else:
        settings.admission.server = WebhookServer(port=SETTINGS.webhook_port, host=SETTINGS.webhook_host)
    settings.admission.managed = f"{GROUP}.admission"


WRITES: list[kopf.Operation] = ["CREATE", "UPDATE"]


@kopf.on.validate(GROUP, VERSION, "loraadapters", id="loraadapters", operations=WRITES, ignore_failures=True)
async def admit_adapter(spec: kopf.Spec, name: str | None, namespace: str | None, **kwargs: Any) -> None:
    if not sets_spec(kwargs["operation"], kwargs["old"], spec, kwargs["meta"]):
        return
    ns = namespace or "default"
    base = await cluster.get_custom(ns, "basemodels", str(spec.get("baseModel", "")))
    holder = served_name_holder(kwargs["served_names"], ns, name or "", spec)  # the reconcile's index
    problems = review_adapter(
        spec, base.get("spec") if base else None, name=name or "", served_by=holder, policy=SETTINGS.policy(ns)
    )  # fmt: skip
    if problems:
        raise kopf.AdmissionError("; ".join(problems), code=422)


@kopf.on.validate(GROUP, VERSION, "basemodels", id="basemodels", operations=WRITES, ignore_failures=True)
def admit_base(spec: kopf.Spec, **kwargs: Any) -> None:
    if not sets_spec(kwargs["operation"], kwargs["old"], spec, kwargs["meta"]):
        return
    problems = review_base(spec)
    if problems:
        raise kopf.AdmissionError("; ".join(problems), code=422)
