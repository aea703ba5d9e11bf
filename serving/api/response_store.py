"""The Responses API's stored responses: what ``previous_response_id`` goes on from and what
``GET`` and ``DELETE /v1/responses/{id}`` read, kept in the replica's memory.

Each entry holds the response object and its whole conversation as Responses input items (the
items it went on from, its own input, its output), so going on from it reads one entry however
long the chain, and evicting an older response breaks no later one. The ``instructions`` are not
among the items: as OpenAI's, a response's instructions are not carried over to the next.

Entries are keyed by tenant, so a tenant never reads, continues or deletes another's response
(an id of another tenant's is as unknown as one never issued). The store is bounded by a count
and by bytes, least recently used first out; an evicted or unknown id is OpenAI's
``previous_response_not_found``. It is lost when the replica restarts, as vLLM's in-memory store
is: a client that must not lose a conversation sends it whole (``store: false``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 128 << 20


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it ended
    items: list[dict[str, Any]]  # the conversation as input items, its output last
    size: int  # bytes of both as JSON: what the byte bound counts


class ResponseStore:
    """Stored responses by (tenant, id), least recently used first out. Used on the event loop
    only, so it takes no lock."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the stored responses' bounds must not be negative")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str | None, body: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep a response; False when the store is off or the one response is over the byte
        bound by itself (it is then not kept, and its id cannot be gone on from)."""
        size = len(json.dumps(body)) + len(json.dumps(items))
        if not self.enabled or size > self.max_bytes:
            return False
        key = (tenant, str(body["id"]))
        self._drop(key)
        self._entries[key] = StoredResponse(body, items, size)
        self.bytes += size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((tenant, response_id))
        if entry is not None:
            self._entries.move_to_end((tenant, response_id))
        return entry

    def delete(self, tenant: str | None, response_id: str) -> bool:
        return self._drop((tenant, response_id))

    def _drop(self, key: tuple[str | None, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
