"""A completed step applied to its requests: emitted tokens appended, stops found.

Each sampled row emits one token, or, having verified drafts, its verified run plus one;
its accepted drafts' KV becomes computed. A stop inside a run ends the request there (the
rest of the run is wasted, as is every token of a request that had already ended). Rows
that emit one token each, want no logprobs and are still running (almost every step of a
steady batch) are applied over the row table's arrays at once; the others one by one.
Filled blocks are offered to the prefix cache later, in bulk (``Scheduler.register_filled``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from itertools import repeat

import numpy as np

from async_engine.core.request import FinishReason, Request, RequestStatus
from async_engine.core.row_table import ALIVE, PLAIN, RowTable
from streams.plan import PromptLogprobs, StepPlan, StepResult

Finish = Callable[[Request, FinishReason, int | None], None]


def apply_step(
    plan: StepPlan, result: StepResult, table: RowTable, max_model_len: int, finish: Finish
) -> tuple[list[Request], int, np.ndarray, np.ndarray | None]:
    """Returns the requests that got tokens, how many tokens were wasted, and the rows that
    got tokens with how many each (None: one; for the policy's charges)."""
    tokens = np.asarray(result.tokens, np.int64)
    now = time.monotonic()
    if len(tokens) == len(plan.rows) and result.logprobs is None and not len(result.counts):
        rows = plan.rows.astype(np.int64)  # every row sampled one token (a steady batch)
        if (table.flags[rows] == ALIVE | PLAIN).all():
            lists = plan.lists or _lists_of(table, rows)
            return _apply_bulk(
                rows, tokens, plan.requests, lists, table, max_model_len, finish, now
            )
    sampled = plan.num_sampled > 0
    rows = plan.rows[sampled].astype(np.int64)
    counts = result.emitted(len(rows)).astype(np.int64)
    if len(tokens) != int(counts.sum()):
        raise ValueError(f"step {plan.step_id}: {len(tokens)} tokens for {counts.sum()} emitted")
    if result.logprobs is None and not len(result.counts):
        if (table.flags[rows] == ALIVE | PLAIN).all():
            touched, lists = table.requests_of(rows), _lists_of(table, rows)
            return _apply_bulk(rows, tokens, touched, lists, table, max_model_len, finish, now)
    slots = (plan.num_sampled[sampled] - 1).astype(np.int64)
    return _apply_each(rows, counts, slots, tokens, result, table, max_model_len, finish, now)


def record_prompt_scores(scored: list[PromptLogprobs], plan: StepPlan) -> None:
    """A step's prompt logprobs into the requests it ran, by position: position p scores
    the prompt token at p + 1."""
    batch = plan.rows.tolist()
    for row, first, logprobs, ranks, tops in scored:
        req = plan.requests[batch.index(row)]
        if req.prompt_scores is None:
            continue
        scores = req.prompt_scores
        for i, (logprob, rank, top) in enumerate(zip(logprobs, ranks, tops, strict=True)):
            at = first + 1 + i
            if at < len(scores):
                scores[at] = (logprob, rank, top)


def _lists_of(table: RowTable, rows: np.ndarray) -> tuple[list, list]:
    row_list = rows.tolist()
    return list(map(table.outputs.__getitem__, row_list)), list(
        map(table.times.__getitem__, row_list)
    )


def _apply_bulk(
    rows: np.ndarray,
    tokens: np.ndarray,
    touched: list[Request],
    lists: tuple[list, list],
    table: RowTable,
    max_model_len: int,
    finish: Finish,
    now: float,
) -> tuple[list[Request], int, np.ndarray, np.ndarray | None]:
    """One token each, for rows all still running and wanting no logprobs (``lists``: their
    requests' output and token-time lists)."""
    held = table.tokens[rows] + 1
    table.tokens[rows] = held
    table.inflight[rows] -= 1
    table.last_token[rows] = tokens
    deque(map(list.append, lists[0], tokens.tolist()), 0)
    deque(map(list.append, lists[1], repeat(now)), 0)
    if table.num_fresh:  # some row had no output yet: this is its first token
        for i in np.flatnonzero(held == table.prompt[rows] + 1).tolist():
            touched[i].first_token_time = now
            table.num_fresh -= 1
    ending = held >= table.limit[rows]
    for stop in table.stop_ids.tolist():
        ending |= tokens == stop
    for i in np.flatnonzero(ending).tolist():
        req, token = touched[i], int(tokens[i])
        reason = check_stop(req, token, max_model_len)
        if reason is not None:
            finish(req, reason, token if reason is FinishReason.STOP else None)
    return touched, 0, rows, None


def _apply_each(
    rows: np.ndarray,
    counts: np.ndarray,
    slots: np.ndarray,
    tokens: np.ndarray,
    result: StepResult,
    table: RowTable,
    max_model_len: int,
    finish: Finish,
    now: float,
) -> tuple[list[Request], int, np.ndarray, np.ndarray]:
    touched: list[Request] = []
    kept_rows: list[int] = []
    kept: list[int] = []
    logprobs, top = result.logprobs, result.top_logprobs
    wasted = at = 0
    for row, count, k in zip(rows.tolist(), counts.tolist(), slots.tolist(), strict=True):
        req = table.requests[row]
        run = tokens[at : at + count].tolist()
        first = at
        at += count
        if req is None or not table.alive(row):
            wasted += count  # launched before the request ended
            continue
        table.inflight[row] -= 1
        table.drafts[row] -= k
        if req.status is RequestStatus.RUNNING:  # a preempted request's KV is gone
            table.computed[row] += count - 1  # the verified drafts' KV
        taken = 0
        for j, token in enumerate(run):
            req.output_ids.append(token)
            req.token_times.append(now)
            if logprobs is not None:
                req.output_logprobs.append(logprobs[first + j])
                if top is not None:
                    req.output_top_logprobs.append(top[first + j])
            table.tokens[row] += 1
            table.last_token[row] = token
            taken += 1
            if req.first_token_time is None:
                req.first_token_time = now
                table.num_fresh -= 1
            if token in req.stop_ids or table.tokens[row] >= req.token_limit:
                reason = check_stop(req, token, max_model_len)
                if reason is not None:
                    finish(req, reason, token if reason is FinishReason.STOP else None)
                    break
        wasted += count - taken
        touched.append(req)
        kept_rows.append(row)
        kept.append(taken)
    return touched, wasted, np.array(kept_rows, np.int64), np.array(kept, np.int64)


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
