"""The Responses API's stored responses: what ``previous_response_id`` goes on from and what
``GET`` and ``DELETE /v1/responses/{id}`` read, kept in the replica's memory.

Each entry holds the response object and its whole conversation as Responses input items (the
items it went on from, its own input, its output without log-probabilities), so going on from
it reads one entry however long the chain, and evicting an older response breaks no later one.
The ``instructions`` are not among the items: as OpenAI's, a response's instructions are not
carried over to the next.

Entries are keyed by tenant, so a tenant never reads, continues or deletes another's response
(an id of another tenant's is as unknown as one never issued). The store is bounded by a count
and by bytes, and kept as encoded JSON, so the bytes bound is the memory it holds. When it is
full, the tenant holding the most gives up its least recently used response: a tenant storing
a flood of responses pushes out its own, not a quieter tenant's. An evicted or unknown id is
OpenAI's ``previous_response_not_found``. The store is lost when the replica restarts, as vLLM's
in-memory store is: a client that must not lose a conversation sends it whole (``store: false``).
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_BYTES = 128 << 20


class StoredResponse:
    """One kept response, decoded as far as a caller reads it (``GET`` wants the body, going on
    from it the items)."""

    def __init__(self, encoded: tuple[bytes, bytes]) -> None:
        self._encoded = encoded

    @functools.cached_property
    def body(self) -> dict[str, Any]:
        """The response object, as it ended."""
        body: dict[str, Any] = json.loads(self._encoded[0])
        return body

    @functools.cached_property
    def items(self) -> list[dict[str, Any]]:
        """The conversation as input items, its output last."""
        items: list[dict[str, Any]] = json.loads(self._encoded[1])
        return items

    def input_items(self) -> list[dict[str, Any]]:
        """The items it was given: all but its output."""
        return self.items[: len(self.items) - len(self.body["output"])]


@dataclass
class _Shelf:
    """One tenant's entries, least recently used first, and the bytes they hold."""

    entries: OrderedDict[str, tuple[bytes, bytes]]
    bytes: int = 0


class ResponseStore:
    """Stored responses by (tenant, id). Used on the event loop only, so it takes no lock."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the stored responses' bounds must not be negative")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._shelves: dict[str | None, _Shelf] = {}
        self.count = self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return self.count

    def put(self, tenant: str | None, body: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep a response; False when the store is off or the one response is over the byte
        bound by itself (it is then not kept, and its id cannot be gone on from)."""
        encoded = json.dumps(body).encode(), json.dumps([_without_logprobs(item) for item in items]).encode()
        size = len(encoded[0]) + len(encoded[1])
        if not self.enabled or size > self.max_bytes:
            return False
        self.delete(tenant, str(body["id"]))
        shelf = self._shelves.setdefault(tenant, _Shelf(OrderedDict()))
        shelf.entries[str(body["id"])] = encoded
        shelf.bytes += size
        self.count, self.bytes = self.count + 1, self.bytes + size
        while self.count > self.max_responses or self.bytes > self.max_bytes:
            self._evict()
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        shelf = self._shelves.get(tenant)
        encoded = shelf.entries.get(response_id) if shelf is not None else None
        if shelf is None or encoded is None:
            return None
        shelf.entries.move_to_end(response_id)
        return StoredResponse(encoded)

    def delete(self, tenant: str | None, response_id: str) -> bool:
        shelf = self._shelves.get(tenant)
        encoded = shelf.entries.pop(response_id, None) if shelf is not None else None
        if shelf is None or encoded is None:
            return False
        size = len(encoded[0]) + len(encoded[1])
        shelf.bytes -= size
        self.count, self.bytes = self.count - 1, self.bytes - size
        if not shelf.entries:
            del self._shelves[tenant]
        return True

    def _evict(self) -> None:
        """The least recently used response of the tenant holding the most: bytes when over the
        bytes bound, responses when over the count."""
        over_bytes = self.bytes > self.max_bytes
        tenant, shelf = max(self._shelves.items(), key=lambda kv: kv[1].bytes if over_bytes else len(kv[1].entries))
        self.delete(tenant, next(iter(shelf.entries)))


def _without_logprobs(item: dict[str, Any]) -> dict[str, Any]:
    """An item as a conversation needs it: an answer's text parts without their
    log-probabilities (the response object keeps them)."""
    content = item.get("content")
    if not isinstance(content, list):
        return item
    parts = [{k: v for k, v in part.items() if k != "logprobs"} if isinstance(part, dict) else part for part in content]
    return {**item, "content": parts}
