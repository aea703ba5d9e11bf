"""Where an adapter's traffic goes, shared by the simulator, the router and the operator (torch-free):
consistent hashing with bounded loads, and the dominance rule behind dedicated deployments."""

from loraplane.routing.bounded_hash import BoundedLoadRing

__all__ = ["BoundedLoadRing"]
