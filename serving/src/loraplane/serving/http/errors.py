"""OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``) and the status codes
that go with each failure, so the official clients raise the exception users expect."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane.admin_api.auth import tokens_carried


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after = retry_after


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def api_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return JSONResponse(error_body(exc.message, exc.type, exc.code, exc.param), status_code=exc.status, headers=headers)


def invalid_request(errors: Sequence[Any]) -> APIError:
    """OpenAI's 400 for a body that breaks the schema, naming the first field at fault."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return APIError(400, message, code="invalid_request", param=param)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI answers 422; OpenAI answers 400 with the first problem spelled out."""
    assert isinstance(exc, RequestValidationError)
    return await api_error_handler(request, invalid_request(exc.errors()))


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (an unknown route or method, a body it cannot even decode) in
    OpenAI's shape too, instead of ``{"detail": ...}``, keeping their headers (``Allow``)."""
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if exc.status_code != 404 else f"Invalid URL ({request.method} {request.url.path})"
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(message), type_), status_code=exc.status_code, headers=exc.headers)


async def require_admin(
    request: Request, token: str | None, *, reader_token: str | None = None, admin_hosts: frozenset[str] = frozenset()
) -> None:
    """401 unless no admin token is set or the request carries it, as a bearer or as a signature
    of this request (``admin_api.auth``; ``admin_hosts``: the addresses a signature may name).
    ``reader_token`` is accepted too where a call only reads (the router's stats token)."""
    if token and not await tokens_carried(request, [t for t in (token, reader_token) if t], admin_hosts):
        raise APIError(401, "admin calls need the admin token", type_="authentication_error", code="invalid_api_key")
