"""A step's running decodes, chosen and planned over the row table's arrays all at once.

Every running request with one token to feed gets it (and the draft slots the speculation
policy grants it), in running order while the budget lasts; the blocks they need come from
the pool in one call. The row table's columns for these rows are gathered once, worked on
as contiguous arrays and scattered back once. Where the pool lacks a block one needs, the
scheduler chooses them one by one instead (``RowChooser.decodes``, which may preempt): what
these arrays compute is what that loop does when nobody is preempted.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.plan_builder import PlanPart
from async_engine.core.policy import Policy
from async_engine.core.request import Request
from async_engine.core.running import Running
from streams.plan import DRAFT, PLACEHOLDER, RESOLVE

# Draft slots wanted for each of the running rows (int64 [R] -> int64 [R]) in a step (its
# id), given the step's tokens no prompt wants (see ``Speculation.slots``).
DraftSlots = Callable[[np.ndarray, int, int], np.ndarray]


def plan_decodes(
    kv: KVCacheManager,
    policy: Policy,
    running: Running,
    rows: np.ndarray,
    budget: int,
    draft_slots: DraftSlots | None,
    step_id: int,
    waiting_tokens: int = 0,
) -> tuple[PlanPart | None, list[Request], int] | None:
    """The decodes among the ``running`` requests (``rows``: theirs) within ``budget``: their
    plan part (None if there are none), the requests with more than one token to feed (prompt
    chunks, in running order, up to where the budget ran out) and the budget left. None
    where the pool lacks a block one needs. ``waiting_tokens``: prompt tokens of waiting
    requests this step may admit, which draft slots should not displace either."""
    t = kv.rows
    computed, inflight, drafts = t.computed[rows], t.inflight[rows], t.drafts[rows]
    pending = t.tokens[rows] + inflight
    room = t.limit[rows] - pending - drafts  # tokens it may still be given
    feed = pending - computed
    decode = (feed == 1) & (room > 0)
    slots, lists = None, None
    if draft_slots is None and len(rows) <= budget and decode.all():
        chunks: list[Request] = []  # the steady batch: every row decodes, all in the budget
        requests, lists = list(running), (list(running.outputs), list(running.times))
    else:
        chunk = (room > 0) & (feed > 1)
        wanted = np.zeros(len(rows), np.int64)
        if draft_slots is not None:
            prompt_tokens = int(feed[chunk].sum()) + waiting_tokens
            spare = max(budget - int(decode.sum()) - prompt_tokens, 0)
            wanted = np.where(decode, np.clip(draft_slots(rows, step_id, spare), 0, room - 1), 0)
        cost = np.where(decode, 1 + wanted, 0)
        before = np.cumsum(cost) - cost
        visited = before < budget  # the budget runs out before the rest
        chunks = t.requests_of(rows[chunk & visited]) if chunk.any() else []
        chosen = np.flatnonzero(decode & visited)
        slots = np.minimum(wanted, budget - before - 1)[chosen]
        rows, computed, inflight, drafts = (
            rows[chosen],
            computed[chosen],
            inflight[chosen],
            drafts[chosen],
        )
        requests = t.requests_of(rows)
    if not len(rows):
        return None, chunks, budget
    ends = computed + drafts + 1 if slots is None else computed + drafts + 1 + slots
    new_blocks = _grow(kv, rows, ends)
    if new_blocks is None:
        return None  # one by one, preempting where it must
    if policy.charges_service:  # a prompt's last token, left by a chunk
        for row in rows[computed < t.prompt[rows]].tolist():
            policy.charge_prompt(t.requests[row], 1)
    # Launched: the token fed (from the device's buffer where it is in flight) and the slots.
    fed = np.where(inflight > 0, PLACEHOLDER, t.last_token[rows])
    starts = np.where(drafts > 0, RESOLVE, computed) if drafts.any() else computed
    t.computed[rows] = computed + 1
    t.inflight[rows] = inflight + 1
    t.launched[rows] = step_id
    if slots is not None and slots.any():
        sizes = 1 + slots
        ids = np.full(int(sizes.sum()), DRAFT, np.int64)
        ids[np.cumsum(sizes) - sizes] = fed
        t.drafts[rows] = drafts + slots
    else:
        sizes, ids = _ones(len(rows)), fed
    part = PlanPart(rows, starts, sizes, sizes, ids, requests, [], new_blocks, lists)
    return part, chunks, budget - int(sizes.sum())


def _grow(kv: KVCacheManager, rows: np.ndarray, ends: np.ndarray) -> list[int] | None:
    """Blocks so that each row holds ``ends`` tokens, from one allocation (the pool hands out
    what one by one would); their (row, block) pairs, or None if the pool is short."""
    t = kv.rows
    need = -(-ends // kv.block_size) - t.blocks[rows]
    growing = np.flatnonzero(need > 0)
    if not len(growing):
        return []
    need = need[growing]
    total = int(need.sum())
    blocks = kv.pool.allocate(total) if total <= kv.pool.num_free else None
    if blocks is None:
        return None
    pairs: list[int] = []
    at = 0
    for row, k in zip(rows[growing].tolist(), need.tolist(), strict=True):
        req, got = t.requests[row], blocks[at : at + k]
        at += k
        req.block_ids += got
        for block in got:
            pairs += (row, block)
        req.num_sent_blocks = len(req.block_ids)
    t.blocks[rows[growing]] += need
    return pairs


def _ones(n: int, cache: dict[int, np.ndarray] = {}) -> np.ndarray:  # noqa: B006 -- a cache
    """int32 ones, read only (a steady batch's query lengths every step)."""
    ones = cache.get(n)
    if ones is None:
        ones = cache[n] = np.ones(n, np.int32)
        ones.flags.writeable = False
        if len(cache) > 64:
            cache.pop(next(iter(cache)))
    return ones
