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
from async_engine.core.request import PromptScore
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
    prompt_scores: list[PromptScore | None] | None = None


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
        self._emitted: list[int] = []  # while streaming: tokens each choice has sent

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
        if len(sub.prompts) == 1 or sub.messages is not None:
            prompt = sub.prompts[0] if sub.prompts else None
            try:
                self.group = self.state.submit(prompt, sub.params, self.engine_id, options)
            except Exception as exc:
                raise refusal(exc) from None
            self.prompt_tokens = self.group.children[0].num_prompt_tokens
            return
        # A batch: one group per prompt, merged into one whose index i*n + j is prompt i's
        # j-th sample (OpenAI's order); all queued or none.
        groups: list[RequestGroup] = []
        try:
            for i, prompt in enumerate(sub.prompts):
                groups.append(
                    self.state.submit(prompt, sub.params, f"{self.engine_id}/{i}", options)
                )
        except Exception as exc:
            for group in groups:
                group.release()
            raise refusal(exc) from None
        children = [child for group in groups for child in group.children]
        self.group = RequestGroup(self.engine, self.engine_id, children, groups[0].on_release)
        self.prompt_tokens = sum(group.children[0].num_prompt_tokens for group in groups)

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
            _extend(c, self._shown(delta))
            if delta.finished:
                c.finish_reason = finish_reason(delta.finish_reason)
        completion = sum(len(c.token_ids) for c in choices)
        answer = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.sub.model,
            "choices": [self._choice(i, c) for i, c in enumerate(choices)],
            "usage": usage(self.prompt_tokens, completion, self.cached_tokens),
        }
        if self.chat and self.sub.show_prompt_logprobs:
            answer["prompt_logprobs"] = self._prompt_logprobs(0, choices[0])
        return answer

    def _shown(self, delta: RequestDelta) -> Choice:
        """The part of a delta the client sees: with max_tokens 0 (echo, score only) none of
        what was generated."""
        part = _part(delta)
        if self.sub.score_only:
            part.text, part.token_ids, part.logprobs, part.top_logprobs = "", [], [], []
        return part

    def _prompt_ids(self, index: int) -> list[int]:
        return self.group.children[index].prompt_ids

    def _echo_text(self, index: int) -> str:
        """Choice ``index``'s prompt as sent (token ids: as they decode)."""
        original = self.sub.originals[index // self.sub.params.n]
        if isinstance(original, str):
            return original
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(original, False) if tokenizer is not None else ""

    def _prompt_logprobs(self, index: int, c: Choice) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs shape: None first, then {token id: {logprob, rank,
        decoded_token}} for the prompt token and the top-n at its position."""
        if c.prompt_scores is None:
            return None
        tokenizer = self.engine.tokenizer
        piece = (lambda t: tokenizer.decode([t], False)) if tokenizer else str
        out: list[dict[str, Any] | None] = []
        for token, score in zip(self._prompt_ids(index), c.prompt_scores, strict=True):
            if score is None:
                out.append(None)
                continue
            logprob, rank, top = score
            entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": piece(token)}}
            for place, (t, v) in enumerate(top, 1):
                entry.setdefault(str(t), {"logprob": v, "rank": place, "decoded_token": piece(t)})
            out.append(entry)
        return out

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
        text = self._echo_text(index) + c.text if self.sub.echo else c.text
        if self.sub.echo and logprobs is not None:
            logprobs = self._echo_logprobs(index, c)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }
        if self.sub.show_prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs(index, c)
        return choice

    def _echo_logprobs(self, index: int, c: Choice) -> dict[str, Any]:
        """Legacy logprobs over the prompt's tokens, then the completion's: the prompt's
        first token has none (nothing precedes it)."""
        tokenizer = self.engine.tokenizer
        piece = (lambda t: tokenizer.decode([t], False)) if tokenizer else str
        ids = self._prompt_ids(index)
        scores = c.prompt_scores or [None] * len(ids)
        pieces = [piece(t) for t in ids]
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        after = self._logprobs(c, at)
        return {
            "tokens": pieces + after["tokens"],
            "token_logprobs": [s[0] if s else None for s in scores] + after["token_logprobs"],
            "top_logprobs": [{piece(t): v for t, v in s[2]} if s else None for s in scores]
            + after["top_logprobs"],
            "text_offset": offsets + after["text_offset"],
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
        self._emitted = emitted
        echoed = [not (self.sub.echo and not self.chat)] * n
        async for index, delta in self.deltas():
            part = self._shown(delta)
            emitted[index] += len(part.token_ids)
            reason = finish_reason(delta.finish_reason) if delta.finished else None
            if tools is not None:
                _extend(held[index], part)
                for event in self._tool_events(
                    index, streams[index], held[index], delta.text, reason
                ):
                    yield event
                continue
            text = part.text
            logprobs = None
            if not echoed[index]:  # the prompt goes first, in the choice's first chunk
                echoed[index] = True
                text = self._echo_text(index) + text
                if wants_logprobs:
                    logprobs = self._echo_logprobs(index, part)
                    offsets[index] = sum(len(t) for t in logprobs["tokens"])
            elif wants_logprobs and part.token_ids:
                logprobs = self._logprobs(part, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.get("tokens", ()))
            if not (text or reason is not None or logprobs is not None):
                continue
            content = {"content": text} if self.chat else text
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
        if self.sub.continuous_usage:
            body["usage"] = usage(self.prompt_tokens, sum(self._emitted), self.cached_tokens)
        return f"data: {json.dumps(body)}\n\n"


def _extend(whole: Choice, part: Choice) -> None:
    if whole.prompt_scores is None:
        whole.prompt_scores = part.prompt_scores
    whole.text += part.text
    whole.token_ids += part.token_ids
    whole.logprobs += part.logprobs
    whole.top_logprobs += part.top_logprobs


def _part(delta: RequestDelta) -> Choice:
    part = Choice(delta.text, delta.token_ids, delta.logprobs or [], delta.top_logprobs or [])
    part.prompt_scores = delta.prompt_logprobs
    return part
