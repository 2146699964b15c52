"""What structured output costs: the offline workload with every request constrained.

The schema is an array of at least 10,000 short strings, so no request can finish before
``max_tokens`` and both runs generate the same number of tokens; the ratio is then the
cost of filling and applying the grammar masks on the device.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sampler.params import SamplingParams

LONG_ARRAY = {
    "type": "array",
    "items": {"type": "string", "maxLength": 8},
    "minItems": 10_000,
}


def run_structured(options: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens/s of the workload with every request under the LONG_ARRAY schema."""
    from async_engine.core.llm import LLM

    spec = ("json_schema", json.dumps(LONG_ARRAY))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec)
    with LLM(**{**options, "overlap": True}) as llm:
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, structured_output=spec))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    if tokens != max_tokens * len(prompts):
        raise RuntimeError(f"structured run generated {tokens} tokens, not all max_tokens")
    return tokens / wall
