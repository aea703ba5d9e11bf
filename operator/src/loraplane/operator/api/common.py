"""Shapes both resources use: Kubernetes conditions, Secret references, quotas.

Field names are the Kubernetes spelling (camelCase) on the wire and snake_case in Python; every
model forbids unknown fields and is strict about types (``"yes"`` is not a boolean), as the API
server is, so a typo in a manifest is an error rather than a silently ignored setting.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from loraplane import admin_api

GROUP = "loraplane.dev"
VERSION = "v1alpha1"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SOURCE_URI = r"^(s3|file)://.+$"  # where adapter files may come from (SOURCE_SCHEMES)


class KubeModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)

    def body(self) -> dict[str, object]:
        """The JSON the API server stores (camelCase, unset optionals left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Condition(KubeModel):
    """A Kubernetes status condition (the shape of metav1.Condition)."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339", json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(default=None, ge=0)


class SecretRef(KubeModel):
    name: str = Field(min_length=1, max_length=253)


# The admin API's quotas in camelCase: one definition of the names, bounds and meaning. No
# docstring: the CRD reference's notes describe where each resource uses it.
class Quotas(KubeModel, admin_api.Quotas):
    pass


class ObjectMeta(BaseModel):
    """The metadata fields the operator reads; the rest passes through untouched."""

    model_config = ConfigDict(extra="allow")

    name: str
    namespace: str | None = None
    generation: int | None = None
    uid: str | None = None
