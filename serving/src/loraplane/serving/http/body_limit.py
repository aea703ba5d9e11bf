"""The body cap of the OpenAI API (the replica's server and the router): the shared ASGI cap
(``admin_api.body_limit``) answering with OpenAI's error body, so the official clients raise
their usual exception."""

from __future__ import annotations

from functools import partial
from typing import Any

from loraplane.admin_api.body_limit import DEFAULT_MAX_BODY_BYTES
from loraplane.admin_api.body_limit import BodyLimit as _BodyLimit
from loraplane.serving.http.errors import error_body

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodyLimit"]


class BodyLimit(_BodyLimit):
    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        super().__init__(app, max_bytes, partial(error_body, type_="invalid_request_error", code="request_too_large"))
