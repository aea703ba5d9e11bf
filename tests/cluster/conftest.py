"""What the cluster tests share: the story e2e/test_cluster.py leaves running in the cluster."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml
from kubectl import get
from scenario import example_manifests


@pytest.fixture(scope="module")
def story() -> dict[str, Any]:
    """The demo's namespace, BaseModel, first adapter and its tenant's API key, as test_cluster left them."""
    base, adapters = example_manifests()
    ns, name = base["metadata"]["namespace"], base["metadata"]["name"]
    secret = get("secret", ns, base["spec"]["tenancy"]["apiKeysSecret"]["name"])
    tenants = yaml.safe_load(base64.b64decode(secret["data"]["tenants.yaml"]))["tenants"]
    adapter = adapters[0]
    key = next(t["api_keys"][0] for t in tenants if t["name"] == adapter["spec"]["tenant"])
    return {"ns": ns, "base": name, "adapter": adapter["metadata"]["name"], "key": key,
            "serving": f"loraplane.dev/base-model={name},app.kubernetes.io/component=serving"}  # fmt: skip
