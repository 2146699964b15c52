"""Intake: a submission checked, built into a ``Request`` and queued, or refused by name.

The slow parts of a submission (templating a chat, tokenizing a long text, compiling a
grammar) run in ``prepare`` on one worker thread at a lower CPU priority, not on the event
loop every stream shares. Requests with a queue or time limit are kept aside and ended at
step boundaries once past it (``expire``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from async_engine.core.config import EngineConfig
from async_engine.core.inputs import (
    DuplicateRequestError,
    InputBuilder,
    InputLimits,
    QueueFullError,
)
from async_engine.core.request import FinishReason, Request
from async_engine.core.scheduler import Scheduler
from async_engine.core.tokenizer import Tokenizer
from async_engine.model.config import ModelConfig
from sampler.params import SamplingParams


def _lower_thread_priority() -> None:
    """Nice the calling thread (Linux schedules threads alone); elsewhere, nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class Intake:
    OFF_LOOP_CHARS = 16_384  # text prompts at least this long are tokenized off the loop

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        tokenizer_text: str | None,
        scheduler: Scheduler,
        max_model_len: int,
        num_blocks: int,
    ) -> None:
        eos, bs = tuple(model_config.eos_token_ids), config.block_size
        limits = InputLimits(model_config.vocab_size, max_model_len, num_blocks, bs, eos)
        self.inputs = InputBuilder(limits, tokenizer)
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.tokenizer_text = tokenizer_text  # where the device process reads it (grammars)
        self.vocab_size = model_config.vocab_size
        self.config = config  # read at each submission: max_waiting may be changed live
        # The simulated device does not constrain output.
        self.constrains_output = config.resolved_device() != "sim"
        self.timed: list[Request] = []  # requests with a queue or time limit
        self._grammars: Any = None  # streams.grammar.Grammars, on the first structured request
        # One thread, niced: a flood of heavy submissions queues behind itself and yields
        # the cores to the event loop and the device instead of taking them.
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="prepare", initializer=_lower_thread_priority
        )

    def build(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None,
        request_id: str | None,
        in_flight: bool,
        options: dict[str, Any],
    ) -> Request:
        """A checked request, ready to queue; ``in_flight``: its id is taken."""
        if in_flight:
            # An ended request keeps its id until its last launched step has completed.
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        if params is not None and params.structured_output is not None:
            self.check_structured_output(params)
        req = self.inputs.build(prompt, params, request_id=request_id, **options)
        limit = self.config.max_waiting
        if self.scheduler.num_waiting >= limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests)")
        return req

    def queued(self, req: Request) -> None:
        if req.queue_deadline is not None or req.time_deadline is not None:
            self.timed.append(req)

    async def prepare(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str | list[int] | None:
        """See ``AsyncEngine.prepare``."""
        loop = asyncio.get_running_loop()
        if messages is not None:
            if prompt is not None:
                raise ValueError("prompt: give either a prompt or messages, not both")
            self.inputs.check_chat_fits(messages)
        if params is not None and params.structured_output is not None:
            await loop.run_in_executor(self._pool, self.check_structured_output, params)
        if messages is not None:
            return await loop.run_in_executor(self._pool, self.inputs.chat_ids, messages, tools)
        if not isinstance(prompt, str) or len(prompt) < self.OFF_LOOP_CHARS or not self.tokenizer:
            return prompt
        self.inputs.check_text_fits(prompt)
        return await loop.run_in_executor(self._pool, self.tokenizer.encode, prompt)

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile the request's grammar here first, so a bad one is a ValueError naming
        structured_output at submission, never a failed step on the device. The first call
        reads the tokenizer's vocabulary (under a second) and leaves it for the device process
        in ``tokenizer_text``; compiled grammars are cached."""
        spec = params.structured_output
        if spec is None:
            return
        if not self.constrains_output:
            raise ValueError("structured_output: the simulated device does not constrain output")
        from streams.grammar import Grammars, TokenizerText

        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_output needs the model's tokenizer")
            text = TokenizerText.of(self.tokenizer.hf)
            if self.tokenizer_text is not None:
                text.save(self.tokenizer_text)
            self._grammars = Grammars(text, self.vocab_size)
        self._grammars.compile(*spec)

    def expired(self, now: float) -> list[tuple[Request, FinishReason]]:
        """Requests past their queue or time limit, with the reason to end them."""
        keep, due = [], []
        for req in self.timed:
            if req.finished:
                continue
            if (
                req.queue_deadline is not None
                and req.scheduled_time is None
                and now >= req.queue_deadline
            ):
                due.append((req, FinishReason.QUEUE_TIMEOUT))
            elif req.time_deadline is not None and now >= req.time_deadline:
                due.append((req, FinishReason.TIME_LIMIT))
            else:
                keep.append(req)
        self.timed = keep
        return due

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
