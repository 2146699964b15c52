"""Turns the scheduler's choice for a step into a ``StepPlan``, and moves each request as
launched: ``num_computed_tokens`` to the end of what the step computes, a step that samples
one more step in flight (and its draft slots), and the blocks and table resets the device
has not seen yet go out with the plan.

A step's rows come in two parts: the running decodes, chosen and planned over the row
table's arrays all at once (``core/bulk_decodes.py``), then prompt chunks and admissions,
planned request by request (``chosen_part``); ``build_plan`` joins them in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from async_engine.core.request import Request
from async_engine.core.row_table import RowTable
from streams.plan import PLACEHOLDER, RESOLVE, NewRow, StepPlan

_NONE32 = np.zeros(0, np.int32)


def new_row(req: Request) -> NewRow:
    """What the device needs to know of a request it has not seen yet (its row's state)."""
    return NewRow(req.row, req.params, list(req.prompt_ids), list(req.ordered_stop_ids))


@dataclass(slots=True)
class PlanPart:
    """Some rows of a step, in batch order."""

    rows: np.ndarray
    starts: np.ndarray
    query_lens: np.ndarray
    num_sampled: np.ndarray
    input_ids: np.ndarray
    requests: list[Request]
    resets: list[int]
    new_blocks: list[int]  # (row, block) pairs
    lists: tuple[list, list] | None = None  # the requests' output and token-time lists


def chosen_part(chosen: list[tuple[Request, int]], table: RowTable, step_id: int) -> PlanPart:
    """``n`` tokens for each (request, n) from its computed ones: prompt chunks, admissions
    and decodes planned one by one (a step that preempts)."""
    rows: list[int] = []
    starts: list[int] = []
    query_lens: list[int] = []
    sampled: list[int] = []
    inputs: list[int] = []
    resets: list[int] = []
    new_blocks: list[int] = []
    for req, n in chosen:
        row = req.row
        start, known = int(table.computed[row]), int(table.tokens[row])
        inflight = int(table.inflight[row])
        rows.append(row)
        # Drafts of it still in flight: only the device knows how many it verified.
        starts.append(RESOLVE if table.drafts[row] else start)
        query_lens.append(n)
        end = start + n
        if start >= known:  # the token was sampled by a step in flight
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
        takes = end == known + inflight  # it reaches the row's end: the next token is sampled
        sampled.append(int(takes))
        table.computed[row] = end
        table.inflight[row] = inflight + takes
        table.launched[row] = step_id
    return PlanPart(
        np.array(rows, np.int64),
        np.array(starts, np.int64),
        np.array(query_lens, np.int64),
        np.array(sampled, np.int64),
        np.array(inputs, np.int64),
        [req for req, _ in chosen],
        resets,
        new_blocks,
    )


def build_plan(
    step_id: int, parts: list[PlanPart], new_rows: list[NewRow], released_rows: list[int]
) -> StepPlan:
    def joined(name: str, dtype: type) -> np.ndarray:
        if len(parts) == 1:
            return getattr(parts[0], name).astype(dtype, copy=False)
        return np.concatenate([getattr(p, name) for p in parts]).astype(dtype, copy=False)

    lists = None
    if len(parts) == 1:
        requests, lists = parts[0].requests, parts[0].lists
        resets, new_blocks = parts[0].resets, parts[0].new_blocks
    else:
        requests = [r for p in parts for r in p.requests]
        resets = [r for p in parts for r in p.resets]
        new_blocks = [b for p in parts for b in p.new_blocks]
    return StepPlan(
        step_id=step_id,
        rows=joined("rows", np.int32),
        starts=joined("starts", np.int32),
        query_lens=joined("query_lens", np.int32),
        num_sampled=joined("num_sampled", np.int32),
        input_ids=joined("input_ids", np.int64),
        new_rows=new_rows,
        released_rows=np.array(released_rows, np.int32) if released_rows else _NONE32,
        reset_rows=np.array(resets, np.int32) if resets else _NONE32,
        new_blocks=np.array(new_blocks, np.int32) if new_blocks else _NONE32,
        requests=requests,
        lists=lists,
    )
