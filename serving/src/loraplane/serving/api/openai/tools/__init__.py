"""Function calls: forced by ``tool_choice`` through structured output (``calls``), or read back
from the model's own format with ``"auto"`` (``parsers``, vLLM's ``--tool-call-parser``)."""
