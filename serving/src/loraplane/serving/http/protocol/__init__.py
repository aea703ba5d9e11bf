"""OpenAI's request and response bodies (and vLLM's extras), as pydantic models: one module per
endpoint family, what they share in ``common``. The server and the router both read them."""
