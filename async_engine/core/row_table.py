"""The scheduler's counters of every request that holds a device row, as arrays by row.

At a GPU's 1 ms steps and a batch of hundreds, touching every request twice a step in
Python is most of the control plane's time. So from the moment a request takes a row until
its row is retired, its counters live here, one array entry per row: the scheduler plans
a step's decodes and applies its tokens over the arrays, all rows at once, and only the
rows a step changes in other ways (a prompt chunk, a stop, an admission, a preemption) go
through Python. ``Request``'s counter properties read these arrays, so nothing is ever
stale; only the scheduler's parts write them.
"""

from __future__ import annotations

import numpy as np

from async_engine.core.request import Request

_COUNTERS = ("tokens", "computed", "inflight", "drafts", "launched")  # as Request.counters
# Every per-row integer, as the rows of one 2-D array: a step gathers the columns of its rows
# once (``table.counters[:, rows]``), works on that copy and scatters it back once.
FIELDS = (
    *_COUNTERS,
    *("limit", "prompt", "blocks", "hashed", "last_token", "flags", "tenant", "drafted", "kept"),
)
# flags: attached and not finished; no logprobs wanted (applied in bulk); may speculate
ALIVE, PLAIN, SPECULATE = 1, 2, 4


class RowTable:
    tokens: np.ndarray  # prompt + output applied
    computed: np.ndarray  # KV written by launched steps (drafts once verified)
    inflight: np.ndarray  # launched steps that will bring a token
    drafts: np.ndarray  # draft slots in those steps
    launched: np.ndarray  # the last step launched with the row
    limit: np.ndarray  # token_limit
    prompt: np.ndarray
    blocks: np.ndarray  # len(block_ids)
    hashed: np.ndarray  # len(block_hashes)
    last_token: np.ndarray  # the newest token held
    flags: np.ndarray  # ALIVE | PLAIN | SPECULATE
    tenant: np.ndarray  # index into tenant_names
    drafted: np.ndarray  # drafts the row verified
    kept: np.ndarray  # of them, kept

    def __init__(self, rows: int = 64) -> None:
        self.size = rows
        self.counters = np.zeros((len(FIELDS), rows), np.int64)
        self._name_rows()
        self.launched[:] = -1
        self.requests: list[Request | None] = [None] * rows
        self.outputs: list[list[int] | None] = [None] * rows  # each request's output_ids
        self.times: list[list[float] | None] = [None] * rows  # each request's token_times
        # Every attached request's stop ids (a superset is fine: candidates are checked)
        self.stop_ids = np.zeros(0, np.int64)
        self.num_fresh = 0  # attached requests that have no output token yet
        self.tenant_names: list[str] = []
        self._tenant_index: dict[str, int] = {}
        self._tenant_rows: list[int] = []  # rows attached per tenant index

    def _name_rows(self) -> None:
        for i, name in enumerate(FIELDS):
            setattr(self, name, self.counters[i])

    # ------------------------------------------------------------ attach, detach
    def attach(self, req: Request, row: int) -> None:
        """``req`` takes ``row``: its counters move here until ``detach``."""
        if row >= self.size:
            self._grow(max(2 * self.size, row + 1))
        tokens, computed, inflight, drafts, launched = req.counters
        self.tokens[row], self.computed[row], self.inflight[row] = tokens, computed, inflight
        self.drafts[row], self.launched[row] = drafts, launched
        self.limit[row] = req.token_limit
        self.prompt[row] = len(req.prompt_ids)
        self.blocks[row] = len(req.block_ids)
        self.hashed[row] = len(req.block_hashes)
        self.last_token[row] = req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
        params = req.params
        plain = getattr(params, "logprobs", None) is None
        speculate = getattr(params, "speculate", True)
        flags = (0 if req.finished else ALIVE) | (PLAIN if plain else 0)
        self.flags[row] = flags | (SPECULATE if speculate else 0)
        self.drafted[row] = self.kept[row] = 0
        self.tenant[row] = self._tenant_of(req.tenant)
        self.requests[row], self.outputs[row], self.times[row] = (
            req,
            req.output_ids,
            req.token_times,
        )
        new_stops = [t for t in req.stop_ids if t not in set(self.stop_ids.tolist())]
        if new_stops:
            self.stop_ids = np.concatenate((self.stop_ids, np.array(new_stops, np.int64)))
        if req.first_token_time is None:
            self.num_fresh += 1
        req.row, req.counters = row, self

    def detach(self, req: Request) -> int:
        """``req`` gives its row back: its counters move back onto it. Returns the row."""
        row = req.row
        if row is None or req.counters is not self:
            raise ValueError(f"request {req.request_id!r} holds no row of this table")
        req.counters = [int(getattr(self, name)[row]) for name in _COUNTERS]
        req.row = None
        if req.first_token_time is None:
            self.num_fresh -= 1
        self.flags[row] &= ~ALIVE
        self.requests[row] = self.outputs[row] = self.times[row] = None
        index = int(self.tenant[row])
        self._tenant_rows[index] -= 1
        if self._tenant_rows[index] == 0:  # names of tenants gone are not kept
            del self._tenant_index[self.tenant_names[index]]
        return row

    def reset_outputs(self, req: Request) -> None:
        """``req`` starts over with new output lists (a lost device): point at them."""
        row = req.row
        if row is not None:
            self.outputs[row], self.times[row] = req.output_ids, req.token_times

    def finished(self, req: Request) -> None:
        if req.row is not None:
            self.flags[req.row] &= ~ALIVE

    def alive(self, row: int) -> bool:
        return bool(self.flags[row] & ALIVE)

    # ------------------------------------------------------ detached or attached
    def set_computed(self, req: Request, computed: int) -> None:
        if req.row is None:
            req.counters[1] = computed
        else:
            self.computed[req.row] = computed

    def set_blocks(self, req: Request) -> None:
        """The request's block list changed (allocated, looked up, hashed or taken away)."""
        if req.row is not None:
            self.blocks[req.row] = len(req.block_ids)
            self.hashed[req.row] = len(req.block_hashes)

    def start_over(self, req: Request) -> None:
        """Counters as a fresh request's (its row is gone with its device)."""
        req.counters = [len(req.prompt_ids), 0, 0, 0, -1]

    # ----------------------------------------------------------------- helpers
    def requests_of(self, rows: np.ndarray) -> list[Request]:
        return list(map(self.requests.__getitem__, rows.tolist()))

    def tenant_counts(self, rows: np.ndarray, counts: np.ndarray | None = None) -> dict[str, int]:
        """Tokens by tenant name: one per row of ``rows``, or ``counts``."""
        if len(self._tenant_index) == 1:
            return {
                next(iter(self._tenant_index)): len(rows) if counts is None else int(counts.sum())
            }
        totals = np.bincount(self.tenant[rows], weights=counts)
        return {self.tenant_names[i]: int(totals[i]) for i in np.flatnonzero(totals).tolist()}

    def _tenant_of(self, name: str) -> int:
        index = self._tenant_index.get(name)
        if index is None:
            if len(self.tenant_names) > 2 * len(self._tenant_index) + 16:
                self._compact_tenants()
            index = self._tenant_index[name] = len(self.tenant_names)
            self.tenant_names.append(name)
            self._tenant_rows.append(0)
        self._tenant_rows[index] += 1
        return index

    def _compact_tenants(self) -> None:
        """Drop the names of tenants with no attached row (renumbering the others)."""
        live = sorted(self._tenant_index.values())
        remap = np.zeros(len(self.tenant_names), np.int64)
        remap[live] = np.arange(len(live))
        attached = [r for r, req in enumerate(self.requests) if req is not None]
        self.tenant[attached] = remap[self.tenant[attached]]
        self.tenant_names = [self.tenant_names[i] for i in live]
        self._tenant_rows = [self._tenant_rows[i] for i in live]
        self._tenant_index = {name: i for i, name in enumerate(self.tenant_names)}

    def _grow(self, rows: int) -> None:
        grown = np.zeros((len(FIELDS), rows), np.int64)
        grown[:, : self.size] = self.counters
        self.counters = grown
        self._name_rows()
        for name in ("requests", "outputs", "times"):
            getattr(self, name).extend([None] * (rows - self.size))
        self.size = rows
