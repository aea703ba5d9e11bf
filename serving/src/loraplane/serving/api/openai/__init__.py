"""OpenAI's routes, by concept: ``/v1/models`` and which model a request names (``models_routes``),
completions and chat (``completions``), the Responses API (``responses``), function calls
(``tools``), and vLLM's tokenizer routes (``tokenize_routes``)."""
