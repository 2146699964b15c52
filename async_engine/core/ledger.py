"""The deferred-free ledger: blocks of a request that ended or was preempted, and the row
and id of one that ended, go back only once every launched step that uses them has
completed (``step_completed``), because under overlap the next step may already be
writing them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from async_engine.core.kv_manager import KVCacheManager
from async_engine.core.request import Request
from async_engine.core.row_table import RowTable


@dataclass(slots=True)
class PendingFree:
    """Blocks to free once step ``after_step`` has completed (and the request to retire)."""

    after_step: int
    blocks: list[int]
    request: Request | None  # a finished request: its row and id are released too


class ReleaseLedger:
    def __init__(self, kv: KVCacheManager, requests: dict[str, Request], rows: RowTable) -> None:
        self.kv = kv
        self.rows = rows
        self.requests = requests  # the scheduler's, by id: a retired request leaves it
        self.completed_step_id = -1
        self.pending: list[PendingFree] = []
        self._free_rows: list[int] = []
        self._num_rows = 0
        self._released_rows: list[int] = []  # sent with the next plan

    def take_row(self, req: Request) -> int:
        """A device row for ``req`` (its counters move into the row table with it)."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            self._num_rows += 1
            row = self._num_rows - 1
        self.rows.attach(req, row)
        return row

    def take_released_rows(self) -> list[int]:
        """Rows retired since the last plan (the next plan tells the device)."""
        released, self._released_rows = self._released_rows, []
        return released

    def blocks_arriving(self) -> int:
        return sum(len(p.blocks) for p in self.pending)

    def step_completed(self, step_id: int) -> None:
        """The device finished ``step_id`` (and every step before it): their blocks are idle."""
        self.completed_step_id = max(self.completed_step_id, step_id)
        if not self.pending:
            return
        still: list[PendingFree] = []
        for pending in self.pending:
            if pending.after_step <= self.completed_step_id:
                self.kv.free(pending.blocks)
                if pending.request is not None:
                    self._retire(pending.request)
            else:
                still.append(pending)
        self.pending = still

    def free_after_launch(self, req: Request) -> None:
        """Free now if no launched step still uses the blocks, else after that step."""
        retire = req if req.finished else None
        if req.last_launched_step <= self.completed_step_id:
            self.kv.release(req)
            if retire is not None:
                self._retire(retire)
            return
        self.pending.append(PendingFree(req.last_launched_step, self.kv.detach(req), retire))

    def reset_rows(self) -> None:
        """The device and its rows are gone: the next device's rows start from 0 (every
        request has given its row back)."""
        self._free_rows, self._num_rows, self._released_rows = [], 0, []

    def _retire(self, req: Request) -> None:
        """A finished request whose blocks are back: its row and its id are free again."""
        req.released_time = time.monotonic()
        if req.row is not None:
            row = self.rows.detach(req)
            self._released_rows.append(row)
            self._free_rows.append(row)
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
