"""The serving engine, its OpenAI-compatible server and the adapter-affinity router.

Layers, one way (import-linter contracts): demo -> bench -> api -> http -> engine -> lora -> weights
-> model; the router reaches only http of those; serving imports kernels, never the reverse. See
docs/architecture.md.
"""

from importlib.metadata import version

__version__ = version("loraplane-serving")  # what vLLM's /version answers, from the installed distribution
