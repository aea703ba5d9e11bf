"""``/v1/completions`` and ``/v1/chat/completions`` (``routes``), and what the Responses API runs
through too: a request's sampling, prompts and admission (``generation``), its choices
(``choices``), its stream (``streaming``) and its log-probabilities (``logprobs``)."""
