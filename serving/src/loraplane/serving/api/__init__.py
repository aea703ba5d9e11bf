"""The OpenAI-compatible HTTP server around the engine."""
