"""Turns the scheduler's choice for a step, (request, tokens) pairs, into a ``StepPlan``.

It advances each request as launched: ``num_computed_tokens`` moves to the end of what
the step computes, a step that samples adds a token in flight, and the blocks and table
resets the device has not seen yet go out with the plan.
"""

from __future__ import annotations

from async_engine.core.request import Request
from streams.plan import PLACEHOLDER, NewRow, StepPlan, bools, int32s, int64s


def new_row(req: Request) -> NewRow:
    """What the device needs to know of a request it has not seen yet (its row's state)."""
    return NewRow(req.row, req.params, list(req.prompt_ids), list(req.ordered_stop_ids))


def build_plan(
    step_id: int,
    chosen: list[tuple[Request, int]],
    new_rows: list[NewRow],
    released_rows: list[int],
) -> StepPlan:
    rows: list[int] = []
    starts: list[int] = []
    query_lens: list[int] = []
    sample: list[bool] = []
    inputs: list[int] = []
    resets: list[int] = []
    new_blocks: list[int] = []
    requests: list[Request] = []
    # Bound methods held in locals: this loop runs for every request on every step.
    add_row, add_start, add_len = rows.append, starts.append, query_lens.append
    add_sample, add_input, add_request = sample.append, inputs.append, requests.append
    for req, n in chosen:
        start = req.num_computed_tokens
        known = req.num_tokens
        row = req.row
        add_row(row)
        add_start(start)
        add_len(n)
        add_request(req)
        end = start + n
        if start >= known:  # steady decode: the token was sampled by a step in flight
            if n == 1:
                add_input(PLACEHOLDER)
            else:
                inputs += [PLACEHOLDER] * n
        elif end <= known:
            inputs += req.tokens_between(start, end)
        else:
            inputs += req.tokens_between(start, known)
            inputs += [PLACEHOLDER] * (end - known)
        if req.table_reset:
            resets.append(row)
            req.table_reset = False
        if len(req.block_ids) > req.num_sent_blocks:
            for block in req.block_ids[req.num_sent_blocks :]:
                new_blocks += (row, block)
            req.num_sent_blocks = len(req.block_ids)
        if end == known + req.num_inflight:
            add_sample(True)
            req.num_inflight += 1
        else:
            add_sample(False)
        req.num_computed_tokens = end
        req.last_launched_step = step_id
    return StepPlan(
        step_id=step_id,
        rows=int32s(rows),
        starts=int32s(starts),
        query_lens=int32s(query_lens),
        sample=bools(sample),
        input_ids=int64s(inputs),
        new_rows=new_rows,
        released_rows=int32s(released_rows),
        reset_rows=int32s(resets),
        new_blocks=int32s(new_blocks),
        requests=requests,
    )
