"""Requests, scheduling, KV blocks, sampling and the step loop."""
