"""The kopf operator reconciling BaseModel and LoraAdapter resources (see issue: Operator and CRDs).

It imports neither torch, triton nor the engine; it talks to serving replicas over their HTTP
admin API and validates adapters with :mod:`loraplane.adapter_format`.
"""
