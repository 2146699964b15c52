"""What a request's consumer receives, and how deltas queue up for slow readers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from async_engine.core.request import FinishReason, PromptScore, Request
from async_engine.core.stops import stop_automaton
from async_engine.core.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class RequestDelta:
    """New output of one request since the previous delta it yielded.

    ``offset`` is the output position of ``token_ids[0]``; a consumer that concatenates
    deltas in order gets every token exactly once.
    """

    request_id: str
    offset: int
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With prompt_logprobs, on the request's first delta: each prompt token's score (the
    # first token's None).
    prompt_logprobs: list[PromptScore | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def merge(self, later: RequestDelta) -> None:
        """Append a later delta to this one (a slow reader gets one larger chunk)."""
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + later.top_logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.timings = later.timings or self.timings


def delta_bytes(delta: RequestDelta) -> int:
    """About what a delta holds in memory: ids, text, logprobs (for the unread budget)."""
    size = 8 * len(delta.token_ids) + len(delta.text)
    if delta.logprobs:
        size += 16 * len(delta.logprobs)
    if delta.top_logprobs:
        size += 32 * sum(len(top) for top in delta.top_logprobs)
    if delta.prompt_logprobs:
        size += sum(24 + 32 * len(s[2]) for s in delta.prompt_logprobs if s is not None)
    return size


@dataclass(slots=True)
class UnreadBudget:
    """Bytes of output waiting for readers, per stream and in all (the engine's limits)."""

    per_stream: int
    total_limit: int
    total: int = 0


class RequestStream:
    """A request's pending output: the engine never waits for the reader.

    ``final_only`` wakes the reader once, at the end, with everything merged: an offline
    caller that wants whole results should not cost the control plane a wake-up per token.
    """

    def __init__(self, final_only: bool = False, budget: UnreadBudget | None = None) -> None:
        self._pending: RequestDelta | None = None
        self._ready = asyncio.Event()
        self._final_only = final_only
        self.budget = budget
        self.pending_bytes = 0  # what waits for the reader
        self.delivered_tokens = 0  # handed to the reader so far

    def put(self, delta: RequestDelta) -> None:
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        if self.budget is not None:
            size = delta_bytes(delta)
            self.pending_bytes += size
            self.budget.total += size
        if delta.finished or not self._final_only:
            self._ready.set()

    def over_budget(self) -> bool:
        budget = self.budget
        if budget is None or not self.pending_bytes:
            return False
        return self.pending_bytes > budget.per_stream or budget.total > budget.total_limit

    def discard(self) -> None:
        """The reader is gone: what it left unread no longer counts."""
        if self.budget is not None:
            self.budget.total -= self.pending_bytes
        self.pending_bytes = 0

    def drop_pending(self) -> None:
        """Forget output the reader has not taken (it is being computed afresh)."""
        self.discard()
        self._pending = None
        self._ready.clear()

    async def get(self) -> RequestDelta:
        await self._ready.wait()
        self._ready.clear()
        delta, self._pending = self._pending, None
        assert delta is not None  # the event is set only together with a pending delta
        self.discard()
        self.delivered_tokens += len(delta.token_ids)
        return delta


class OutputProcessor:
    """Per request: detokenize new tokens, match stop strings, hold back a possible match."""

    def __init__(
        self,
        req: Request,
        tokenizer: Tokenizer | None,
        detokenize: bool,
        final_only: bool,
        budget: UnreadBudget | None = None,
    ) -> None:
        self.req = req
        self.stream = RequestStream(final_only, None if final_only else budget)
        params = req.params
        self._tokenizer = tokenizer if detokenize else None
        self.detok = self._new_detokenizer()
        self.stops: tuple[str, ...] = tuple(params.stop) if self.detok is not None else ()
        self.matcher = stop_automaton(self.stops) if self.stops else None
        self.match_state = 0
        self.hold = 0  # trailing characters that may still become a stop string
        # Nothing to do before the end: no reader per token, no stop string to look for.
        self.quiet_until_finished = final_only and not self.stops
        # Stop strings are matched as text arrives, so that generation ends on time.
        self.wants_every_step = bool(self.stops)
        self.last_emit = 0.0  # when the engine last built a delta for this reader
        self.text = ""
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        self.sent_prompt_logprobs = False

    def _new_detokenizer(self) -> IncrementalDetokenizer | None:
        if self._tokenizer is None:
            return None
        req = self.req
        return IncrementalDetokenizer(
            self._tokenizer, req.prompt_ids, req.params.skip_special_tokens
        )

    def start_over(self) -> None:
        """The request is computed afresh (its device was lost before the reader saw any
        output): what was built but not taken is dropped, detokenizing starts again."""
        self.stream.drop_pending()
        self.detok = self._new_detokenizer()
        self.text = ""
        self.num_emitted_tokens = self.num_emitted_chars = 0
        self.match_state = self.hold = 0
        self.sent_prompt_logprobs = False

    def process(self) -> tuple[RequestDelta | None, str | None]:
        """Build the delta for tokens not yet emitted; also returns a stop string that matched."""
        req = self.req
        new_ids = req.output_ids[self.num_emitted_tokens :]
        matched = None
        if new_ids and self.detok is not None:
            before = len(self.text)
            self.text += self.detok.push(new_ids)
            matched = self._match_stop(before)
        finished = req.finished or matched is not None
        if not new_ids and not finished:
            return None, None
        end = (
            len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.hold)
        )
        delta = RequestDelta(
            request_id=req.request_id,
            offset=self.num_emitted_tokens,
            token_ids=list(new_ids),
            text=self.text[self.num_emitted_chars : end],
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )
        if req.params.logprobs is not None:
            delta.logprobs = req.output_logprobs[self.num_emitted_tokens :]
            if req.params.logprobs > 0:
                delta.top_logprobs = req.output_top_logprobs[self.num_emitted_tokens :]
        if req.prompt_scores is not None and not self.sent_prompt_logprobs:
            delta.prompt_logprobs = list(req.prompt_scores)
            self.sent_prompt_logprobs = True
        self.num_emitted_tokens = len(req.output_ids)
        self.num_emitted_chars = end
        return delta, matched

    def _match_stop(self, before: int) -> str | None:
        """Feed the new text to the stop automaton; on the first stop string completed, cut
        the text there (keeping the stop string if asked) and return it."""
        if self.matcher is None:
            return None
        state, end, stop = self.matcher.feed(self.match_state, self.text[before:])
        self.match_state = state
        self.hold = self.matcher.depth[state]
        if stop is None:
            return None
        at = before + end - len(stop)
        keep = at + len(stop) if self.req.params.include_stop_str_in_output else at
        self.text = self.text[:keep]
        return stop


def request_timings(req: Request) -> dict[str, float]:
    """Queue time, time to first token and end-to-end latency, in seconds."""
    end = req.finished_time or time.monotonic()
    out = {"e2e_s": end - req.arrival_time}
    if req.scheduled_time is not None:
        out["queue_s"] = req.scheduled_time - req.arrival_time
    if req.first_token_time is not None:
        out["ttft_s"] = req.first_token_time - req.arrival_time
    return out
