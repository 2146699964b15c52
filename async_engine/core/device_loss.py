"""What becomes of requests when their device is lost: it held every launched step's KV
and row tables, so each request it had touched starts over, computed afresh with no
output, or ends."""

from __future__ import annotations

from collections.abc import Callable

from async_engine.core.ledger import ReleaseLedger
from async_engine.core.policy import Policy
from async_engine.core.request import FinishReason, Request, RequestStatus


def settle_device_loss(
    requests: list[Request],
    running: list[Request],
    policy: Policy,
    ledger: ReleaseLedger,
    last_step_id: int,
    finish: Callable[[Request, FinishReason], None],
    can_requeue: Callable[[Request], bool],
    reason: FinishReason,
) -> tuple[list[Request], list[Request]]:
    """Every launched step (to ``last_step_id``) counts as completed and every block and
    row returns: of ``requests``, one the device had touched goes back to waiting where
    ``can_requeue`` allows, and otherwise ends with ``reason`` (``finish``). Waiting
    requests never admitted are untouched. Returns (ended, started over)."""
    ledger.step_completed(last_step_id)
    kv = ledger.kv
    ended: list[Request] = []
    again: list[Request] = []
    for req in requests:
        if req.finished or not (req.status is RequestStatus.RUNNING or req.row is not None):
            continue
        if can_requeue(req):
            was_running = req.status is RequestStatus.RUNNING
            if was_running:
                running.remove(req)
                policy.left_running(req)
            kv.release(req)
            if req.row is not None:
                ledger.rows.detach(req)
            _start_over(req)
            ledger.rows.start_over(req)
            if was_running:
                policy.add(req)
            again.append(req)
        else:
            finish(req, reason)
            ended.append(req)
    for req in requests:  # ended ones hold their rows until now
        if req.row is not None:
            ledger.rows.detach(req)
    ledger.reset_rows()
    kv.pool.reset_prefix_cache()  # the cached KV lived on the lost device
    return ended, again


def _start_over(req: Request) -> None:
    req.status = RequestStatus.WAITING
    req.num_cached_tokens = 0
    req.num_sent_blocks = 0
    req.table_reset = False
    req.output_ids, req.output_logprobs, req.output_top_logprobs = [], [], []
    req.token_times, req.first_token_time = [], None
    req.num_device_losses += 1
