"""A completed step applied to its requests: sampled tokens appended, stops found, blocks
just filled registered with the prefix cache."""

from __future__ import annotations

import time
from collections.abc import Callable

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.request import FinishReason, Request, RequestStatus
from streams.plan import StepPlan


def apply_step(
    plan: StepPlan,
    tokens: list[int],
    logprobs: list[float] | None,
    top_logprobs: list[list[tuple[int, float]]] | None,
    kv: KVCacheManager,
    register: bool,
    max_model_len: int,
    finish: Callable[[Request, FinishReason, int | None], None],
) -> tuple[list[Request], int]:
    """Returns the requests that got a token, and how many tokens were wasted (sampled for
    a request that had ended). ``register``: full blocks join the prefix cache. The hot
    loop: every request of every step."""
    now = time.monotonic()
    touched: list[Request] = []
    tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    bs = kv.block_size
    finished = RequestStatus.FINISHED
    add_touched = touched.append
    row = wasted = 0
    for req, sampled in zip(plan.requests, plan.sample.tolist(), strict=True):
        if not sampled:
            if register and req.status is not finished:
                kv.register_full_blocks(req)
            continue
        token = tokens[row]
        if req.status is finished:
            wasted += 1  # launched before the request ended
            row += 1
            continue
        req.num_inflight -= 1
        req.output_ids.append(token)
        req.num_tokens += 1
        req.token_times.append(now)
        if logprobs is not None:
            req.output_logprobs.append(logprobs[row])
            if top_logprobs is not None:
                req.output_top_logprobs.append(top_logprobs[row])
        row += 1
        if req.first_token_time is None:
            req.first_token_time = now
        # Only a step that completes a block has anything to register.
        if register and req.num_computed_tokens // bs > len(req.block_hashes):
            kv.register_full_blocks(req)
        if token in req.stop_ids or req.num_tokens >= req.token_limit:
            reason = check_stop(req, token, max_model_len)
            if reason is not None:
                finish(req, reason, token if reason is FinishReason.STOP else None)
        add_touched(req)
    return touched, wasted


def check_stop(req: Request, token: int, max_model_len: int) -> FinishReason | None:
    """Why ``req`` ends at ``token``, its newest, if it does."""
    params = req.params
    if token in req.stop_ids and len(req.output_ids) >= params.min_tokens:
        return FinishReason.STOP if token in params.stop_token_ids else FinishReason.EOS
    if params.max_tokens is not None and len(req.output_ids) >= params.max_tokens:
        return FinishReason.LENGTH
    if req.num_tokens >= max_model_len:
        return FinishReason.CONTEXT_LENGTH
    return None
