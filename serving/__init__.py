"""The serving engine, its OpenAI-compatible server and the adapter-affinity router.

Imports flow api -> engine -> lora -> model, and serving imports kernels, never the reverse.
"""
