"""The adapter-cache simulator and the capacity planner behind ``loraplane sim`` and ``loraplane plan``.

Pure Python on purpose: a platform team runs it on a laptop before it buys GPUs, and it replays
traces through the same eviction and routing objects the engine and router use.
"""
