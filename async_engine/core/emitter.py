"""Output emission: each request's stream, and which readers a step's tokens wake.

A request gets an ``OutputProcessor`` (detokenizing, stop strings, its ``RequestStream``)
when it is queued, until its reader releases it. After a step, ``emit_step`` wakes the
readers of the requests that got a token, as often as the ``StreamPacer`` allows; a
reader that wants whole results only is woken once, at the end.

The emitter ends no request itself: where a request's text reached a stop string, or its
reader fell so far behind that its unread output outgrew the budget, it reports an
``Ending``; the loop ends the request (the scheduler's job) and then the emitter sends the
final delta (``finish_ending``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from async_engine.core.output import OutputProcessor, RequestDelta, UnreadBudget, request_timings
from async_engine.core.pacing import StreamPacer
from async_engine.core.request import FinishReason, Request
from async_engine.core.tokenizer import Tokenizer


@dataclass(slots=True)
class Ending:
    """A running request its own output ended (a stop string, ``stop_reason``) or whose
    reader fell behind (UNREAD): the loop ends it, then ``finish_ending`` sends ``delta``."""

    req: Request
    reason: FinishReason
    stop_reason: str | None = None
    delta: RequestDelta | None = None  # the text up to the stop string, held until then


class Emitter:
    def __init__(self, tokenizer: Tokenizer | None, unread: UnreadBudget) -> None:
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
        """The reader is gone (the request ended, or was ended first): drop its stream."""
        processor = self.processors.pop(req.request_id, None)
        if processor is not None:
            processor.stream.discard()
            if not processor.quiet_until_finished:
                self.num_streaming -= 1

    def emit_step(self, touched: list[Request], ended: list[Request], now: float) -> list[Ending]:
        """Wake the readers of a step's requests (``touched``, of which ``ended`` ended):
        the ended ones always, the others on every step or when the pacer says so. Returns
        the requests to end (their output says so: stop strings, unread budget)."""
        if not self.num_streaming:  # only whole results are wanted: emit just the ended
            touched = ended
        processors, pacer = self.processors, self.pacer
        endings: list[Ending] = []
        for req in touched:
            processor = processors.get(req.request_id)
            if processor is None:
                continue
            if not (req.finished or processor.wants_every_step):
                if processor.quiet_until_finished or not pacer.due(processor.last_emit, now):
                    continue  # its tokens wait for the next wake-up, merged into one chunk
            processor.last_emit = now
            ending = self.emit(req)
            if ending is not None:
                endings.append(ending)
        return endings

    def emit(self, req: Request) -> Ending | None:
        """Send the request's new output to its reader (its final delta if it ended); an
        Ending where that output ends a request still running."""
        processor = self.processors.get(req.request_id)
        if processor is None or (processor.quiet_until_finished and not req.finished):
            return None
        delta, matched = processor.process()
        if matched is not None and not req.finished:
            return Ending(req, FinishReason.STOP, matched, delta)
        if delta is None:
            return None
        self._put(req, processor, delta)
        if not req.finished and processor.stream.over_budget():
            # Its reader fell behind: end it rather than hold its output without bound.
            return Ending(req, FinishReason.UNREAD)
        return None

    def finish_ending(self, ending: Ending) -> None:
        """The request of ``ending`` was ended: its reader gets the final delta."""
        processor = self.processors.get(ending.req.request_id)
        if processor is None:
            return
        if ending.delta is not None:
            self._put(ending.req, processor, ending.delta)
        else:
            self.emit(ending.req)

    def _put(self, req: Request, processor: OutputProcessor, delta: RequestDelta) -> None:
        if req.finished:
            delta.finished = True
            delta.finish_reason = req.finish_reason
            delta.stop_reason = req.stop_reason
            delta.timings = request_timings(req)
        processor.stream.put(delta)

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
