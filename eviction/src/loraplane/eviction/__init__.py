"""Eviction policies and the tier they drive, shared by the simulator and the serving engine.

One implementation per idea: ``loraplane sim`` replays traces through exactly the objects that
decide which adapters the engine keeps in device slots and host memory, so a policy that wins in
the simulator is the policy that runs in production. Nothing here imports torch or numpy.
"""

from loraplane.eviction.policies import (
    ONLINE_POLICY_NAMES,
    POLICY_NAMES,
    BeladyPolicy,
    EvictionPolicy,
    LFUAgingPolicy,
    LRUPolicy,
    OnlinePolicyName,
    TinyLFUPolicy,
    make_policy,
)
from loraplane.eviction.tier import Tier, TierFullError

__all__ = [
    "ONLINE_POLICY_NAMES",
    "POLICY_NAMES",
    "BeladyPolicy",
    "EvictionPolicy",
    "LFUAgingPolicy",
    "LRUPolicy",
    "OnlinePolicyName",
    "Tier",
    "TierFullError",
    "TinyLFUPolicy",
    "make_policy",
]
