"""The serving engine, its OpenAI-compatible server and the adapter-affinity router.

Layers, one way (an import-linter contract): demo -> bench, router -> api -> engine -> lora ->
weights -> model; serving imports kernels, never the reverse. See docs/architecture.md.
"""

from importlib.metadata import version

__version__ = version("loraplane-serving")  # what vLLM's /version answers, from the installed distribution
