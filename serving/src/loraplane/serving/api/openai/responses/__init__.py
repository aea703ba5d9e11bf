"""OpenAI's Responses API: ``/v1/responses`` (``routes``) and the responses it keeps (``store``)."""
