"""Log-probabilities as JSON can carry them. JSON has no -inf, and a token the request rules out
(``allowed_token_ids``, an output format, ``min_tokens``) has a log-probability of -inf among
the alternatives shown; Starlette refuses to encode it (a 500) and a stream would send the
invalid ``-Infinity``. vLLM sends such a value as -9999.0, and so does every log-probability
field here."""

from __future__ import annotations

import math

LOWEST_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return LOWEST_LOGPROB if math.isnan(logprob) else max(logprob, LOWEST_LOGPROB)
