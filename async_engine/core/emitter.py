"""Output emission: each request's stream, and which readers a step's tokens wake.

A request gets an ``OutputProcessor`` (detokenizing, stop strings, its ``RequestStream``)
when it is queued, until its reader releases it. After a step, ``emit_step`` wakes the
readers of the requests that got a token, as often as the ``StreamPacer`` allows; a
reader that wants whole results only is woken once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from async_engine.core.output import OutputProcessor, RequestDelta, UnreadBudget, request_timings
from async_engine.core.pacing import StreamPacer
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler
from async_engine.core.tokenizer import Tokenizer


class Emitter:
    def __init__(
        self, scheduler: Scheduler, tokenizer: Tokenizer | None, unread: UnreadBudget
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.unread = unread
        self.pacer = StreamPacer()
        self.processors: dict[str, OutputProcessor] = {}  # per request, until released
        self.num_streaming = 0  # readers that want output before the end

    def open(self, req: Request, detokenize: bool, stream: bool) -> None:
        processor = OutputProcessor(
            req, self.tokenizer, detokenize, final_only=not stream, budget=self.unread
        )
        self.processors[req.request_id] = processor
        if not processor.quiet_until_finished:
            self.num_streaming += 1

    def holds(self, request_id: str) -> bool:
        return request_id in self.processors

    async def stream(self, req: Request) -> AsyncIterator[RequestDelta]:
        """Deltas of a queued request, until its final one."""
        stream = self.processors[req.request_id].stream
        while True:
            delta = await stream.get()
            yield delta
            if delta.finished:
                return

    def release(self, req: Request) -> None:
        """The reader is gone: abort the request if it still runs and drop its stream."""
        if not req.finished:
            self.end(req, FinishReason.ABORTED)
        processor = self.processors.pop(req.request_id, None)
        if processor is not None:
            processor.stream.discard()
            if not processor.quiet_until_finished:
                self.num_streaming -= 1

    def end(self, req: Request, reason: FinishReason) -> None:
        """End a running or waiting request now; its reader gets the final delta."""
        req.abort_time = time.monotonic()
        self.scheduler.finish(req, reason)
        self.emit(req)

    def emit_step(self, touched: list[Request], ended: list[Request], now: float) -> None:
        """Wake the readers of a step's requests (``touched``, of which ``ended`` ended):
        the ended ones always, the others on every step or when the pacer says so."""
        if not self.num_streaming:  # only whole results are wanted: emit just the ended
            touched = ended
        processors, pacer = self.processors, self.pacer
        for req in touched:
            processor = processors.get(req.request_id)
            if processor is None:
                continue
            if not (req.finished or processor.wants_every_step):
                if processor.quiet_until_finished or not pacer.due(processor.last_emit, now):
                    continue  # its tokens wait for the next wake-up, merged into one chunk
            processor.last_emit = now
            self.emit(req)

    def emit(self, req: Request) -> None:
        processor = self.processors.get(req.request_id)
        if processor is None or (processor.quiet_until_finished and not req.finished):
            return
        delta, matched = processor.process()
        if matched is not None and not req.finished:
            self.scheduler.finish(req, FinishReason.STOP, stop_reason=matched)
        if delta is None:
            return
        if req.finished:
            delta.finished = True
            delta.finish_reason = req.finish_reason
            delta.stop_reason = req.stop_reason
            delta.timings = request_timings(req)
        processor.stream.put(delta)
        if not req.finished and processor.stream.over_budget():
            # Its reader fell behind: end it rather than hold its output without bound.
            self.end(req, FinishReason.UNREAD)

    def can_start_over(self, req: Request) -> bool:
        """Whether a request on a lost device may run again from scratch: its reader has
        seen nothing, and it was not on a lost device before (it may be what kills them)."""
        processor = self.processors.get(req.request_id)
        return (
            processor is not None
            and processor.stream.delivered_tokens == 0
            and req.num_device_losses == 0
        )

    def start_over(self, req: Request) -> None:
        self.processors[req.request_id].start_over()
