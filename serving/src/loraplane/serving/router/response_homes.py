"""Which replica holds each stored response of the Responses API, so that a request going on
from one (``previous_response_id``), and ``GET`` or ``DELETE /v1/responses/{id}``, reach the
replica that keeps it: replicas keep their stored responses in their own memory.

The router learns an id from the answer that carried it (a response object, or a stream's
``response.created`` event). An id it has not seen (another router's, or from before a restart)
is found by asking the replicas in turn. The map is bounded; the least recently used id goes
first, and is found again by asking if it comes back.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_HOMES = 100_000  # about 10 MB of ids and names


class ResponseHomes:
    def __init__(self, max_entries: int = MAX_HOMES) -> None:
        self.max_entries = max_entries
        self._homes: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, replica: str) -> None:
        self._homes[response_id] = replica
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        replica = self._homes.get(response_id)
        if replica is not None:
            self._homes.move_to_end(response_id)
        return replica

    def forget(self, response_id: str) -> None:
        self._homes.pop(response_id, None)
