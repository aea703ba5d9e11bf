"""The validating webhook as a cluster uses it: the operator runs with `--webhook-port` (as the chart
starts it, its host pointed at loopback instead of the chart's Service), kopf writes the
ValidatingWebhookConfiguration with its self-signed CA, and the real API server calls it over TLS
on every `kubectl apply`. Deleting still works with the operator, and so the webhook, down."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import examples
from envtest import Kube, control_plane
from operator_process import start_operator, stop

from loraplane.serving.http.loopback import free_port

pytestmark = pytest.mark.slow
NS = "hooked"
CONFIG = "loraplane.dev.admission"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    with control_plane(tmp_path_factory.mktemp("apiserver")) as k:
        k.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield k


def example(kind: str, name: str) -> dict[str, Any]:
    manifest = copy.deepcopy(next(d for d in examples() if d["kind"] == kind))
    manifest["metadata"] = {"name": name, "namespace": NS}
    return manifest


def test_the_api_server_calls_the_webhook_and_deletion_needs_neither(kube: Kube, tmp_path: Path) -> None:
    port = free_port()
    operator = start_operator(kube.kubeconfig, tmp_path / "operator.log", extra_args=("--webhook-port", str(port)),
                              extra_env={"LORAPLANE_WEBHOOK_HOST": "127.0.0.1"})  # fmt: skip
    try:

        def configured() -> dict[str, Any] | None:  # kopf creates the object, then fills in its webhooks
            config = kube.get("ValidatingWebhookConfiguration", None, CONFIG)
            return config if config is not None and config.get("webhooks") else None

        config = kube.wait_for("kopf's webhook configuration", configured)
        hooks = config["webhooks"]
        assert hooks and all(h["clientConfig"]["url"].startswith(f"https://127.0.0.1:{port}/") for h in hooks)
        assert all(h["clientConfig"].get("caBundle") for h in hooks)  # TLS, verified against kopf's own CA

        base = example("BaseModel", "hooked-base")
        assert kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(base)).returncode == 0
        orphan = example("LoraAdapter", "orphan")
        orphan["spec"]["baseModel"] = "nowhere"
        r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(orphan), check=False)
        assert r.returncode != 0 and 'admission webhook "' in r.stderr, r.stderr
        assert "spec.baseModel: BaseModel 'nowhere' does not exist in this namespace" in r.stderr
        assert kube.get("LoraAdapter", NS, "orphan") is None
        adapter = example("LoraAdapter", "kept")
        adapter["spec"]["baseModel"] = "hooked-base"
        assert kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(adapter)).returncode == 0
        kube.wait_for(
            "the operator's finalizer", lambda: (kube.get("LoraAdapter", NS, "kept") or {})["metadata"].get("finalizers")
        )
        claimant = example("LoraAdapter", "claimant")  # wants the name `kept` is served under
        claimant["spec"] |= {"baseModel": "hooked-base", "servedName": "kept"}
        r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(claimant), check=False)
        assert r.returncode != 0 and "'kept' is already served by LoraAdapter 'kept'" in r.stderr, r.stderr
        assert kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(adapter)).returncode == 0  # its own name, again
    finally:
        stop(operator)

    # The operator (and with it the webhook) is down: deleting is still accepted. The finalizer
    # keeps the adapter until an operator is back to take it off every replica.
    assert kube.kubectl("delete", "loraadapter", "kept", "-n", NS, "--wait=false").returncode == 0
    assert kube.get("LoraAdapter", NS, "kept")["metadata"]["deletionTimestamp"]
    operator = start_operator(kube.kubeconfig, tmp_path / "operator-2.log")
    try:
        kube.wait_for("the deletion to finish", lambda: kube.get("LoraAdapter", NS, "kept") is None, timeout=60)
    finally:
        stop(operator)


def test_the_webhook_never_blocks_a_deletion_and_fails_open_after_a_sigkill(kube: Kube, tmp_path: Path) -> None:
    """An adapter whose BaseModel is gone is refused on create, yet a label on it and its deletion
    (the finalizer's removal is an update) pass with the webhook up; a SIGKILLed operator leaves
    its configuration behind, and writes still pass (``failurePolicy: Ignore``: the reconcile
    checks the same rules and says why in conditions)."""
    port = free_port()
    operator = start_operator(kube.kubeconfig, tmp_path / "operator.log", extra_args=("--webhook-port", str(port)),
                              extra_env={"LORAPLANE_WEBHOOK_HOST": "127.0.0.1"})  # fmt: skip
    try:
        config = kube.wait_for(
            "kopf's webhook configuration",
            lambda: (c := kube.get("ValidatingWebhookConfiguration", None, CONFIG)) is not None and c.get("webhooks") and c,
        )
        for hook in config["webhooks"]:
            assert hook["failurePolicy"] == "Ignore" and [r["operations"] for r in hook["rules"]] == [["CREATE", "UPDATE"]]
        base = example("BaseModel", "short-lived")
        assert kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(base)).returncode == 0
        adapter = example("LoraAdapter", "stranded")
        adapter["spec"]["baseModel"] = "short-lived"
        assert kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(adapter)).returncode == 0
        kube.wait_for("the finalizer", lambda: (kube.get("LoraAdapter", NS, "stranded") or {})["metadata"].get("finalizers"))
        assert kube.kubectl("delete", "basemodel", "short-lived", "-n", NS, "--wait=false").returncode == 0
        kube.wait_for("the BaseModel to go", lambda: kube.get("BaseModel", NS, "short-lived") is None, timeout=60)
        late = {**example("LoraAdapter", "late"), "spec": adapter["spec"]}
        again = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(late), check=False)
        assert again.returncode != 0 and "does not exist" in again.stderr, again.stderr  # the webhook is up
        labelled = kube.kubectl("label", "loraadapter", "stranded", "-n", NS, "team=search", check=False)
        assert labelled.returncode == 0, labelled.stderr
        assert kube.kubectl("delete", "loraadapter", "stranded", "-n", NS, "--wait=false").returncode == 0
        kube.wait_for("the deletion to finish", lambda: kube.get("LoraAdapter", NS, "stranded") is None, timeout=60)

        operator.kill()  # no graceful exit: the configuration stays, pointing at nothing
        operator.wait()
        assert kube.get("ValidatingWebhookConfiguration", None, CONFIG) is not None
        orphan = example("LoraAdapter", "while-down")
        orphan["spec"]["baseModel"] = "short-lived"
        r = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(orphan), check=False)
        assert r.returncode == 0, r.stderr
        assert kube.kubectl("delete", "loraadapter", "while-down", "-n", NS).returncode == 0
    finally:
        if operator.poll() is None:
            stop(operator)


def test_in_a_cluster_the_configuration_names_the_service_and_the_certificate_its_dns_name() -> None:
    """The chart's operator (``LORAPLANE_WEBHOOK_SERVICE``) registers its Service, not a URL: the API
    server resolves no cluster DNS names (a URL's host failed open on every call on the one-node
    cluster), while it finds a Service's endpoints itself and checks the certificate against
    ``<name>.<namespace>.svc``."""
    import asyncio
    import base64

    from cryptography import x509

    from loraplane.operator.runtime.webhook_tls import WebhookServer

    port = free_port()

    async def first_config() -> dict[str, Any]:
        server = WebhookServer(addr="127.0.0.1", port=port, service=("lp", "loraplane-webhook"))
        configs = server(lambda *_, **__: None)  # type: ignore[arg-type]
        try:
            return dict(await anext(configs))
        finally:
            await configs.aclose()

    config = asyncio.run(first_config())
    assert "url" not in config
    assert config["service"]["namespace"] == "lp" and config["service"]["name"] == "loraplane-webhook"
    assert config["service"]["path"] == "" and config["service"]["port"] == port  # the Service's port too
    cert = x509.load_pem_x509_certificate(base64.b64decode(config["caBundle"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "loraplane-webhook.lp.svc" in names
