"""One OpenAI request on the engine: its samples as engine requests, and their outputs as
OpenAI choices, whole or as server-sent-event chunks."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from async_engine.core.group import RequestGroup, RequestOptions
from async_engine.core.output import RequestDelta
from async_engine.server.auth import Principal, scoped
from async_engine.server.http.failures import failure, refusal
from async_engine.server.http.protocol import HttpSubmission, finish_reason, usage
from async_engine.server.http.tools import ToolStream
from async_engine.server.state import ServingState


@dataclass(slots=True)
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


class OpenAIGeneration:
    """A completion or chat request: ``chat`` picks the response objects' shapes."""

    def __init__(
        self,
        state: ServingState,
        sub: HttpSubmission,
        chat: bool,
        request_id: str | None,
        principal: Principal | None = None,
    ) -> None:
        self.state, self.engine, self.sub, self.chat = state, state.engine, sub, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        # Engine ids are scoped to the caller: another principal's ids are not visible.
        self.engine_id = scoped(principal, self.id)
        self.created = int(time.time())
        self.group = RequestGroup(self.engine, self.engine_id, [])  # until submitted: none
        self.prompt_tokens = self.cached_tokens = 0

    def submit(self) -> None:
        """Queue the request's samples; HttpError if the engine refuses them."""
        sub = self.sub
        # A whole (non-streamed) answer wants its output once, at the end; until then its
        # client has seen nothing, so a lost device can start it over.
        options = RequestOptions(priority=sub.priority or 0, tenant=sub.user, stream=sub.stream)
        if sub.messages is not None:  # not templated yet (the app templates off the loop)
            options.messages = sub.messages
            if sub.tools is not None and sub.tools.choice != "none":
                options.tools = sub.tools.tools
        try:
            self.group = self.state.submit(sub.prompt, sub.params, self.engine_id, options)
        except Exception as exc:
            raise refusal(exc) from None
        self.prompt_tokens = self.group.children[0].num_prompt_tokens

    def release(self) -> None:
        self.group.release()  # aborts what still runs; its metrics are recorded there

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        async for index, delta in self.group.deltas():
            failed = failure(delta.finish_reason)
            if failed is not None:
                raise failed
            self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
            yield index, delta

    # --------------------------------------------------------------- whole
    async def complete(self) -> dict[str, Any]:
        choices = [Choice() for _ in range(len(self.group))]
        for index, delta in [x async for x in self.deltas()]:
            c = choices[index]
            _extend(c, _part(delta))
            if delta.finished:
                c.finish_reason = finish_reason(delta.finish_reason)
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.sub.model,
            "choices": [self._choice(i, c) for i, c in enumerate(choices)],
            "usage": usage(self.prompt_tokens, completion, self.cached_tokens),
        }

    def _choice(self, index: int, c: Choice) -> dict[str, Any]:
        logprobs = self._logprobs(c) if self.sub.params.logprobs is not None else None
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reason = c.finish_reason
            if self.sub.tools is not None:
                content, calls = self.sub.tools.parse(c.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls"
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        return {
            "index": index,
            "text": c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }

    def _logprobs(self, c: Choice, start: int = 0) -> dict[str, Any]:
        """OpenAI's logprobs of ``c``'s tokens; ``start`` is the completion's text offset of
        its first token (a streamed chunk continues where the last one ended)."""
        tokenizer = self.engine.tokenizer
        piece = (lambda t: tokenizer.decode([t], False)) if tokenizer else str
        pieces = [piece(t) for t in c.token_ids]
        tops = c.top_logprobs or [[] for _ in c.token_ids]
        if self.chat:
            return {
                "content": [
                    {
                        "token": p,
                        "logprob": lp,
                        "bytes": list(p.encode()),
                        "top_logprobs": [
                            {"token": piece(a), "logprob": b, "bytes": list(piece(a).encode())}
                            for a, b in top
                        ],
                    }
                    for p, lp, top in zip(pieces, c.logprobs, tops, strict=False)
                ]
            }
        offsets = []
        for p in pieces:
            offsets.append(start)
            start += len(p)
        return {
            "tokens": pieces,
            "token_logprobs": c.logprobs,
            "top_logprobs": [{piece(a): b for a, b in top} for top in tops],
            "text_offset": offsets,
        }

    # -------------------------------------------------------------- stream
    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per delta, the usage chunk if asked, then [DONE]."""
        n = len(self.group)
        emitted, offsets = [0] * n, [0] * n
        wants_logprobs = self.sub.params.logprobs is not None
        if self.chat:
            for i in range(n):
                yield self._event(i, {"role": "assistant", "content": ""}, None)
        tools = self.sub.tools if self.chat and self.sub.tools is not None else None
        held = [Choice() for _ in range(n)]  # with tools: the answer, for its logprobs
        streams = [ToolStream(tools) for _ in range(n)] if tools is not None else []
        async for index, delta in self.deltas():
            emitted[index] += len(delta.token_ids)
            reason = finish_reason(delta.finish_reason) if delta.finished else None
            part = _part(delta)
            if tools is not None:
                _extend(held[index], part)
                for event in self._tool_events(
                    index, streams[index], held[index], delta.text, reason
                ):
                    yield event
                continue
            if not (delta.text or reason is not None or (wants_logprobs and delta.token_ids)):
                continue
            logprobs = None
            if wants_logprobs:
                logprobs = self._logprobs(part, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.get("tokens", ()))
            content = {"content": delta.text} if self.chat else delta.text
            yield self._event(index, content, reason, logprobs)
        if self.sub.include_usage:
            body = {
                "id": self.id,
                "object": self._chunk_object(),
                "created": self.created,
                "model": self.sub.model,
                "choices": [],
                "usage": usage(self.prompt_tokens, sum(emitted), self.cached_tokens),
            }
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    def _tool_events(
        self, index: int, stream: ToolStream, whole: Choice, text: str, reason: str | None
    ) -> list[str]:
        """A delta of an answer with tools: text that cannot be a call goes out at once; the
        calls (and the answer's logprobs) when it is whole."""
        events = []
        sendable = stream.push(text)
        if sendable:
            events.append(self._event(index, {"content": sendable}, None))
        if reason is not None:
            content, calls = stream.finish()
            logprobs = self._logprobs(whole) if self.sub.params.logprobs is not None else None
            body: dict[str, Any] = {"content": content}
            if calls:
                body["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                reason = "tool_calls"
            if content or calls or logprobs is not None:
                events.append(self._event(index, body, None, logprobs))
            # As OpenAI streams: the finish reason comes in a last chunk of its own (the SDK's
            # stream helper finishes a call's arguments on it).
            events.append(self._event(index, {}, reason))
        return events

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _event(
        self, index: int, content: Any, reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> str:
        key = "delta" if self.chat else "text"
        choice = {"index": index, key: content, "logprobs": logprobs, "finish_reason": reason}
        body = {
            "id": self.id,
            "object": self._chunk_object(),
            "created": self.created,
            "model": self.sub.model,
            "choices": [choice],
        }
        return f"data: {json.dumps(body)}\n\n"


def _extend(whole: Choice, part: Choice) -> None:
    whole.text += part.text
    whole.token_ids += part.token_ids
    whole.logprobs += part.logprobs
    whole.top_logprobs += part.top_logprobs


def _part(delta: RequestDelta) -> Choice:
    return Choice(delta.text, delta.token_ids, delta.logprobs or [], delta.top_logprobs or [])
