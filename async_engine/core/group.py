"""One submission on the engine: its n samples as child requests (the rule is core.fanout's),
queued all or none, their outputs merged into one stream, released together.

Every front end (the gRPC service, the OpenAI HTTP API, the offline ``LLM``) decodes its
wire format into a prompt, SamplingParams, a request id and ``RequestOptions``, calls
``submit`` and reads ``RequestGroup.deltas``; only the mapping of errors to its own wire
format stays with each.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

from async_engine.core.fanout import child_ids, child_params
from async_engine.core.output import RequestDelta
from async_engine.core.request import FinishReason, Request
from sampler.params import SamplingParams

Prompt = str | list[int] | None
Released = Callable[[list[Request]], None]  # a group's children, once, when it is released


@dataclass(slots=True)
class RequestOptions:
    """How a submission runs, besides its prompt and sampling: what ``add_request`` takes."""

    priority: int = 0  # lower runs sooner
    tenant: str = ""
    detokenize: bool = True  # False: token ids only, no text
    stream: bool = True  # False: one whole result at the end (fewer wake-ups)
    max_queue_ms: int | None = None  # not admitted by then: ends with QUEUE_TIMEOUT
    time_limit_ms: int | None = None  # running past it: ends with TIME_LIMIT
    truncate_prompt: bool = False  # keep the prompt's end where it would not fit
    messages: list[dict[str, Any]] | None = None  # a chat not templated yet (no prompt)
    tools: list[dict[str, Any]] | None = None  # with messages: the tools the template lists

    def as_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Engine(Protocol):
    """What a group needs of ``AsyncEngine`` (named here, so that core.group need not
    import the engine, which delegates to it)."""

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, **options: Any
    ) -> Request: ...

    def stream(self, req: Request) -> AsyncIterator[RequestDelta]: ...

    def release(self, req: Request) -> None: ...

    def finish(self, request_id: str, reason: FinishReason = ...) -> bool: ...


class RequestGroup:
    """The child requests of one submission, index i running sample i."""

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        children: list[Request],
        on_release: Released | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id  # the parent's: children are "<id>#<i>" when n > 1
        self.children = children
        self.on_release = on_release
        self._pumps: list[asyncio.Task] = []  # while deltas() merges n > 1 children
        self._released = False

    def __len__(self) -> int:
        return len(self.children)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(index, delta) from every child as they come, until each has sent its final one.

        Children are read by a task each into a queue of one: what a slow reader has not
        taken stays in the engine (but for a delta per child and the one queued), where it
        merges into one larger delta and counts against the unread budget."""
        if len(self.children) == 1:  # the common case needs no task per child
            async for delta in self.engine.stream(self.children[0]):
                yield 0, delta
            return
        arrivals: asyncio.Queue[tuple[int, RequestDelta | Exception]] = asyncio.Queue(1)
        pumps = [
            asyncio.create_task(self._pump(i, req, arrivals)) for i, req in enumerate(self.children)
        ]
        self._pumps += pumps
        try:
            running = len(pumps)
            while running:
                index, delta = await arrivals.get()
                if isinstance(delta, Exception):
                    raise delta
                yield index, delta
                if delta.finished:
                    running -= 1
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._pumps = [p for p in self._pumps if p not in pumps]

    async def _pump(
        self,
        index: int,
        req: Request,
        arrivals: asyncio.Queue[tuple[int, RequestDelta | Exception]],
    ) -> None:
        try:
            async for delta in self.engine.stream(req):
                await arrivals.put((index, delta))
        except Exception as exc:  # a bug of the engine's: the reader raises it
            await arrivals.put((index, exc))

    def abort(self) -> None:
        """End every child still running (ABORTED); its reader still gets a final delta."""
        for req in self.children:
            self.engine.finish(req.request_id)

    def release(self) -> None:
        """The reader is gone: abort what still runs and drop every child's stream. Safe
        to call more than once."""
        if self._released:
            return
        self._released = True
        for pump in self._pumps:  # a reader that left without closing deltas()
            pump.cancel()
        for req in self.children:
            self.engine.release(req)
        if self.on_release is not None:  # after the aborts: every child has its end now
            self.on_release(self.children)


def submit(
    engine: Engine,
    prompt: Prompt,
    params: SamplingParams | None,
    request_id: str | None = None,
    options: RequestOptions | None = None,
    on_release: Released | None = None,
) -> RequestGroup:
    """Queue ``params.n`` children, all or none: if adding child k raises, children
    0..k-1 are released before the error propagates (a refused submission is not seen
    by ``on_release``). No ``request_id``: a fresh one."""
    request_id = request_id or uuid.uuid4().hex
    n = 1 if params is None else params.n
    kwargs = (options or RequestOptions()).as_kwargs()
    group = RequestGroup(engine, request_id, [])
    try:
        for index, child_id in enumerate(child_ids(request_id, n)):
            child = engine.add_request(prompt, child_params(params, n, index), child_id, **kwargs)
            group.children.append(child)
    except BaseException:
        group.release()
        raise
    group.on_release = on_release
    return group
