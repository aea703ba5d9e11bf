"""Which labelled pods are the base's own, before they are sent anything worth reading.

The operator finds serving replicas and node agents by their labels, and any namespace user can
put those labels on a pod of their own; owner references do not help, since whoever can create a
pod can write any owner reference on it. So a pod proves itself instead: it answers a signed call
with a signed answer, which only a holder of the base's token can make (``admin_api.auth``). A
pod that has not proved itself is sent nothing else: not the adapter sources the operator
registers, not a node's staging list. That includes a pod that cannot answer now (unreachable,
loading its base), since a pod posing as a replica could as well answer with an error: the
BaseModel's sync stages what a replica missed once it answers (its stats are checked the same way).

A proof is remembered by the pod's uid and address, so a steady fleet costs no extra call.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from loraplane.operator.runtime.cluster import Replica

log = logging.getLogger(__name__)

MAX_REMEMBERED = 4096  # pods; a proof forgotten is asked again, never trusted without one
_proven: OrderedDict[tuple[str, str], None] = OrderedDict()


async def only_proven(pods: list[Replica], prove: Callable[[Replica], Awaitable[bool | None]]) -> list[Replica]:
    """The ``pods`` whose ``prove`` says True (False: it answered without the signature or refused
    the token, a warning; None: it could not be asked now)."""

    async def kept(pod: Replica) -> bool:
        key = (pod.uid or pod.name, pod.url)
        if key in _proven:
            _proven.move_to_end(key)
            return True
        verdict = await prove(pod)
        if verdict:
            _proven[key] = None
            while len(_proven) > MAX_REMEMBERED:
                _proven.popitem(last=False)
        elif verdict is False:
            log.warning("pod %s at %s has the base's labels but not its token: skipped", pod.name, pod.url)
        else:
            log.info("pod %s at %s could not prove itself a replica now: skipped until it does", pod.name, pod.url)
        return bool(verdict)

    verdicts = await asyncio.gather(*(kept(p) for p in pods))
    return [p for p, keep in zip(pods, verdicts, strict=True) if keep]
