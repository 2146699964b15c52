"""Per-request state the scheduler plans with: plain ints and lists, no torch."""

from __future__ import annotations

import enum
import time
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    EOS = "eos"
    STOP = "stop"  # a stop token id or stop string
    LENGTH = "length"  # max_tokens reached
    CONTEXT_LENGTH = "context_length"  # the model's context is full
    ABORTED = "aborted"
    TIME_LIMIT = "time_limit"
    ERROR = "error"  # the step that carried the request failed
    QUEUE_TIMEOUT = "queue_timeout"  # not admitted within max_queue_ms
    UNREAD = "unread"  # its reader fell behind: unread output outgrew its byte budget
    DEVICE_LOST = "device_lost"  # the device died or hung after output had been delivered

    @property
    def simple(self) -> str:
        """The offline API's three-way reason: "stop" | "length" | "abort" (or "error")."""
        return _SIMPLE[self]


_SIMPLE = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.ABORTED: "abort",
    FinishReason.TIME_LIMIT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.QUEUE_TIMEOUT: "abort",
    FinishReason.UNREAD: "abort",
    FinishReason.DEVICE_LOST: "error",
}


# A prompt token's score: its logprob, its rank at its position, the top-n (id, logprob).
PromptScore = tuple[float, int, list[tuple[int, float]]]


class Request:
    """One sequence being generated.

    Its counters: ``num_tokens`` (prompt plus output applied), ``num_computed_tokens``
    (tokens whose KV a launched step wrote, counting a row's drafts only once verified),
    ``num_inflight`` (steps launched that will each bring at least one token, not applied
    yet) and ``num_drafts_inflight`` (draft slots in those steps, which may bring more); a
    request has ``num_tokens + num_inflight - num_computed_tokens`` tokens to feed. From the
    moment it takes a device row until that row is retired they live in the scheduler's
    ``RowTable`` (``core/row_table.py``), which plans and applies steps over all rows at
    once; these properties read them wherever they are. Only the scheduler writes them.
    """

    __slots__ = (
        "request_id",
        "prompt_ids",
        "output_ids",
        "output_logprobs",
        "output_top_logprobs",
        "prompt_scores",
        "params",
        "eos_ids",
        "stop_ids",
        "ordered_stop_ids",
        "priority",
        "tenant",
        "arrival_seq",
        "status",
        "counters",
        "token_limit",
        "num_cached_tokens",
        "block_ids",
        "block_hashes",
        "hash_chain",
        "row",
        "num_sent_blocks",
        "table_reset",
        "num_preemptions",
        "num_device_losses",
        "finish_reason",
        "stop_reason",
        "arrival_time",
        "scheduled_time",
        "first_token_time",
        "finished_time",
        "token_times",
        "abort_time",
        "released_time",
        "queue_deadline",
        "time_deadline",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        *,
        max_model_len: int,
        eos_ids: tuple[int, ...] = (),
        priority: int = 0,
        tenant: str = "",
        arrival: float | None = None,
        arrival_seq: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # With prompt_logprobs: per prompt token, (logprob, rank, top-n) once scored; the
        # first has none. Kept by position, so a prompt computed again scores the same.
        self.prompt_scores: list[PromptScore | None] | None = None
        if getattr(params, "prompt_logprobs", None) is not None:
            self.prompt_scores = [None] * len(prompt_ids)
        self.params = params
        self.eos_ids = eos_ids
        # Token ids that end the request once min_tokens are out: stop ids, plus EOS. In
        # that order for the device's row (it bans them until min_tokens); as a set here.
        ordered = list(getattr(params, "stop_token_ids", ()))
        if not getattr(params, "ignore_eos", False):
            ordered += [t for t in eos_ids if t not in ordered]
        self.ordered_stop_ids = tuple(ordered)
        self.stop_ids = frozenset(ordered)
        self.priority = priority
        self.tenant = tenant
        self.arrival_seq = arrival_seq
        self.status = RequestStatus.WAITING
        # [tokens, computed, in flight, drafts in flight, last launched step] while the
        # request holds no row; a RowTable while it does (row_table.Counters)
        self.counters: Any = [len(prompt_ids), 0, 0, 0, -1]
        # Where the request ends for length: prompt + max_tokens, capped by the context.
        max_tokens = getattr(params, "max_tokens", None)
        self.token_limit = max_model_len
        if max_tokens is not None:
            self.token_limit = min(max_model_len, len(prompt_ids) + max_tokens)
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        # The hash of every full block of the tokens hashed so far, whether cached or not:
        # tokens never change, so a prefix lookup's hashes serve the later registrations.
        self.hash_chain: list[int] = []
        self.row: int | None = None  # its place on the device, from admission until retired
        self.num_sent_blocks = 0  # how much of block_ids the device's table already holds
        self.table_reset = False  # preempted: the device's table must start over
        self.num_preemptions = 0
        self.num_device_losses = 0  # devices lost while it ran (it was computed afresh)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        now = time.monotonic()
        self.arrival_time = now if arrival is None else arrival
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.token_times: list[float] = []
        self.abort_time: float | None = None
        self.released_time: float | None = None  # its KV blocks went back to the pool
        self.queue_deadline: float | None = None  # monotonic; must be admitted before
        self.time_deadline: float | None = None  # monotonic; ends with TIME_LIMIT after

    @property
    def num_tokens(self) -> int:
        return self.counters[0] if self.row is None else int(self.counters.tokens[self.row])

    @property
    def num_computed_tokens(self) -> int:
        return self.counters[1] if self.row is None else int(self.counters.computed[self.row])

    @property
    def num_inflight(self) -> int:
        return self.counters[2] if self.row is None else int(self.counters.inflight[self.row])

    @property
    def num_drafts_inflight(self) -> int:
        return self.counters[3] if self.row is None else int(self.counters.drafts[self.row])

    @property
    def last_launched_step(self) -> int:
        return self.counters[4] if self.row is None else int(self.counters.launched[self.row])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tokens_between(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def known_tokens(self, end: int) -> list[int]:
        n = len(self.prompt_ids)
        return self.prompt_ids[:end] if end <= n else self.prompt_ids + self.output_ids[: end - n]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, inflight={self.num_inflight})"
        )
