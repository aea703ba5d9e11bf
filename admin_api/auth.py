"""Bearer-token checks, shared by every server that takes an admin token (the replicas' admin API
and the node agent's)."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token``, compared in constant time so the
    answer's timing tells nothing about how much of a guess was right."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())
