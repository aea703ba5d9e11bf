"""Routing decisions shared by the simulator and the adapter-affinity router (torch-free)."""

from loraplane.routing.bounded_hash import BoundedLoadRing

__all__ = ["BoundedLoadRing"]
