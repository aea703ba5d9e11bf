"""Adapters inside the engine: PEFT folders read into the kernels' slot layout."""
