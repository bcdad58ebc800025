"""Request parameters vLLM's schema accepts but its serving code fails on with a 500, refused with a 400
before vLLM parses the request (server.middleware.RequestChecks).

Beam search (`use_beam_search`) ranks a finished beam by its cumulative logprob divided by
`seq_len ** length_penalty` (vLLM 0.32's beam_search/utils.py get_beam_search_score): a `length_penalty` far
enough from 0 underflows that to 0.0 (ZeroDivisionError) or overflows it (OverflowError), and a non-finite
one has no meaning. MAX_LENGTH_PENALTY keeps `seq_len ** length_penalty` within a float's range for any
sequence up to 2**24 tokens (24 * log10(2) * 40 = 289 decades; a float spans 308 each way).
"""

import math
from typing import Any

MAX_LENGTH_PENALTY = 40.0


def problem(request: dict[str, Any]) -> tuple[str, str] | None:
    """(message, param) of the first parameter refused, or None. Types vLLM's schema checks are left to it."""
    penalty = request.get("length_penalty")
    if (
        not request.get("use_beam_search")
        or not isinstance(penalty, int | float)
        or isinstance(penalty, bool)
    ):
        return None
    if not math.isfinite(penalty) or abs(penalty) > MAX_LENGTH_PENALTY:
        return (
            f"length_penalty must be a finite number from {-MAX_LENGTH_PENALTY:g} to {MAX_LENGTH_PENALTY:g} "
            f"with use_beam_search, not {penalty!r}",
            "length_penalty",
        )
    return None
