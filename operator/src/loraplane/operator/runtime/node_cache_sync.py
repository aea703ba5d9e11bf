"""A BaseModel's node caches, each sync: tell every node agent what to hold (``decisions.node_staging``),
read back what it holds, and sum it up for the BaseModel's and each LoraAdapter's status.

Every node of the base gets the same list: the router spreads an adapter's traffic over replicas on
any node, so the hot set belongs on all of them; each agent keeps the head of the list that fits
its own bound and says when the rest did not fit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from loraplane.node_cache.client import AgentUnavailable, AsyncAgentClient
from loraplane.node_cache.models import MAX_STAGED_BASES, StagedAdapter, StagedBase, StagingRequest
from loraplane.node_cache.models import NodeCacheState as AgentState
from loraplane.operator.api.basemodel import MAX_STATUS_NODES, BaseModelSpec, NodeCacheState, NodeCacheStatus
from loraplane.operator.api.loraadapter import MergedModel
from loraplane.operator.children.node_cache import AGENT_PORT
from loraplane.operator.runtime import cluster, decisions
from loraplane.operator.runtime.adapter_flow import serving_source
from loraplane.operator.runtime.conditions import Status
from loraplane.operator.runtime.replica_proof import only_proven

MAX_STAGED = 4096  # the agent's own bound on one staging list
MAX_CALLS = 16  # agents called at once


@dataclass
class NodeCacheSync:
    status: NodeCacheStatus
    nodes_cached: dict[str, int] = field(default_factory=dict)  # served name -> nodes holding its serving version
    condition: tuple[Status, str, str] = ("Unknown", "NoNodeAgents", "")


def candidates(views: list[Any], pins: set[str], rates: dict[str, float]) -> list[decisions.StagingCandidate]:
    """From the base's LoraAdapters (base_sync's AdapterView): each Ready one's serving version, and
    every version a spec asks for that is not serving yet (a new adapter, a promotion)."""
    out = []
    for view in views:
        if view.status.phase == "Failed":
            continue
        serving = serving_source(view.spec, view.status) if view.status.phase == "Ready" else None
        if serving is not None:
            out.append(decisions.StagingCandidate(serving.uri, serving.digest, pinned=view.served in pins,
                                                  prefetch=view.spec.prefetch, rate=rates.get(view.served, 0.0)))  # fmt: skip
        wanted = view.spec.source
        if serving is None or (wanted.uri, wanted.digest) != (serving.uri, serving.digest):
            out.append(decisions.StagingCandidate(wanted.uri, wanted.digest, next_version=True))
    return out


def _node_state(node: str, s: AgentState) -> NodeCacheState:
    reads = s.hits + s.misses
    cached = sum(1 for a in s.staged if a.cached)
    return NodeCacheState(
        node=node, bytes=s.bytes, max_bytes=s.max_bytes, entries=s.entries,
        hit_rate=round(s.hits / reads, 4) if reads else None, staged=cached, staged_missing=len(s.staged) - cached,
        staged_fit=s.staged_fit, base_ready=s.base.ready if s.base else None,
        # The base's copy first; else a merged model's (a dedicated deployment's pods wait on it).
        error=(s.base.error if s.base and s.base.error else next((b.error for b in s.bases if b.error), None)),
    )  # fmt: skip


def condition(spec: BaseModelSpec, nodes: list[NodeCacheState]) -> tuple[Status, str, str]:
    """``NodeCachesReady``: the base on every node (an s3:// one) and the staged set fitting."""
    if not nodes:
        return "False", "NoNodeAgents", "no node agent is Ready (see the DaemonSet <name>-node-cache)"
    mismatched = [n.node for n in nodes if n.error and "BaseDigestMismatch" in n.error]
    if mismatched:
        return "False", "BaseDigestMismatch", f"the base's files differ from spec.source.digest on {', '.join(mismatched[:5])}"
    if spec.source.uri.startswith("s3://"):
        waiting = [n.node for n in nodes if not n.base_ready]
        if waiting:
            return "False", "BaseNotCopied", f"the base is not on {len(waiting)} node(s) yet: {', '.join(waiting[:5])}"
    crowded = [n.node for n in nodes if not n.staged_fit]
    if crowded:
        return "False", "HotSetDoesNotFit", f"the staged adapters exceed nodeCache.size on {', '.join(crowded[:5])}"
    return "True", "Cached", f"{len(nodes)} node(s) hold the base and the staged adapters"


async def sync_node_caches(
    name: str, namespace: str, spec: BaseModelSpec, views: list[Any], pins: set[str], rates: dict[str, float],
    token: str | None, merged: list[MergedModel] | None = None,
) -> NodeCacheSync:  # fmt: skip
    """``merged``: the merged models of the base's dedicated deployments, which every node holds
    beside the base (the agents delete one no longer listed)."""
    staged = decisions.node_staging(candidates(views, pins, rates))[:MAX_STAGED]
    request = StagingRequest(
        adapters=[StagedAdapter(source=c.source, digest=c.digest, pinned=c.pinned) for c in staged],
        # None when there is none: left out of the call, which an agent from before staged bases reads.
        bases=[StagedBase(source=m.uri, digest=m.digest) for m in merged[:MAX_STAGED_BASES]] if merged else None,
    )
    agents = await cluster.ready_pods(namespace, name, "node-cache", "node-cache", AGENT_PORT)
    # The staging list names every tenant's sources: only for the base's own agents, which cannot
    # have started without the token's Secret.
    agents = await only_proven(agents, lambda a: AsyncAgentClient(a.url, token).proven()) if token else []
    calls = asyncio.Semaphore(MAX_CALLS)

    async def one(agent: cluster.Replica) -> tuple[str, AgentState] | None:
        async with calls:  # in parallel: N unreachable nodes cost one timeout per sync, not N
            client = AsyncAgentClient(agent.url, token)
            try:
                await client.stage(request)
                return agent.node or agent.name, await client.state()
            except AgentUnavailable:
                return None  # the next sync tries again

    states = dict(r for r in await asyncio.gather(*(one(a) for a in agents)) if r is not None)
    nodes = [_node_state(node, s) for node, s in sorted(states.items())]
    serving = {v.served: serving_source(v.spec, v.status) for v in views if v.status.phase == "Ready"}
    nodes_cached = (
        {
            served: sum(
                1 for s in states.values() if any(a.cached and (a.source, a.digest) == (src.uri, src.digest) for a in s.staged)
            )
            for served, src in serving.items()
        }
        if states
        else {}
    )  # no agent answered (a roll of the DaemonSet): the adapters' figures stand
    status = NodeCacheStatus(
        nodes=len(nodes), nodes_with_base=sum(1 for n in nodes if n.base_ready), per_node=nodes[:MAX_STATUS_NODES]
    )
    return NodeCacheSync(status, nodes_cached, condition(spec, nodes))
