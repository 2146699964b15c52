"""The Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``), as
the openai SDK's ``client.responses`` and openai-agents' ``OpenAIResponsesModel`` call it.

A request is turned into the chat completion it means (``input`` items as chat messages,
``instructions`` a system message first, function tools and ``tool_choice`` in chat's
shape, ``text.format`` as ``response_format``, ``max_output_tokens`` as ``max_tokens``) and
runs on the same submission path, chat template and tool-call parsing as chat completions;
the answer comes back as output items (a ``message`` with ``output_text``, ``function_call``
items), whole or as the event sequence the SDK parses. Stored responses (``store``, the
default) keep their conversation, so ``previous_response_id`` continues it; the store holds
the last ``MAX_STORED`` responses, and an unknown, deleted or evicted id is a 404 naming it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from async_engine.server.auth import Principal
from async_engine.server.http.errors import HttpError, bad_request
from async_engine.server.http.generate import OpenAIGeneration
from async_engine.server.http.protocol import chat_request, finish_reason
from async_engine.server.http.tools import ToolStream

MAX_STORED = 1000
# Fields that would change the answer and are not built: a 400 naming each.
UNBUILT = ("background", "conversation", "prompt")
# The Responses API's own fields (translated here, or carrying nothing for this engine:
# metadata, include, reasoning, service tiers, cache keys); every other field (temperature,
# top_p, user, parallel_tool_calls, and the chat extensions: seed, ignore_eos, ...) goes on to
# the chat request as given, and is checked there.
OWN = {
    "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "store",
    "previous_response_id", "metadata", "stream", "include", "reasoning", "truncation",
    "service_tier", "safety_identifier", "prompt_cache_key", "max_tool_calls", "messages",
    "stream_options", "user_metadata", *UNBUILT,
}  # fmt: skip


class App(Protocol):
    """What the Responses API needs of the HTTP app."""

    model_names: set[str]
    responses: ResponseStore

    def _admit(self, request: Request) -> Principal | None: ...

    def _authorize(self, request: Request) -> Principal | None: ...

    async def _json(self, request: Request) -> tuple[Any, int]: ...

    async def start(self, *args: Any) -> OpenAIGeneration: ...

    async def whole(self, *args: Any) -> Response: ...

    def stream(self, *args: Any) -> Response: ...


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, the answer's included (no instructions)
    owner: str  # the principal's tenant ("" without auth): only it may read or delete


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED) -> None:
        self.max_responses = max_responses
        self._stored: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, stored: Stored) -> None:
        self._stored[response_id] = stored
        while len(self._stored) > self.max_responses:
            self._stored.popitem(last=False)

    def get(self, response_id: str, owner: str, param: str = "response_id") -> Stored:
        found = self._stored.get(response_id)
        if found is None or found.owner != owner:
            raise HttpError(
                404,
                f"response {response_id!r} is not stored here (never stored, deleted, or "
                f"evicted: the store keeps the last {self.max_responses})",
                param,
                "response_not_found",
            )
        self._stored.move_to_end(response_id)
        return found

    def delete(self, response_id: str, owner: str) -> None:
        self.get(response_id, owner)
        del self._stored[response_id]


def _owner(principal: Principal | None) -> str:
    return "" if principal is None else principal.name


# ------------------------------------------------------------------ endpoints
async def create(app: App, request: Request) -> Response:
    try:
        principal = app._admit(request)
        body, size = await app._json(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", None)
        owner = _owner(principal)
        chat_body, conversation = to_chat(body, app.responses, owner)
        gen = await app.start(request, principal, chat_body, size, chat_request, True)
    except HttpError as exc:
        return exc.response()
    answer = ResponseAnswer(app, gen, body, conversation, owner)
    headers = {"x-request-id": gen.id}
    if gen.sub.stream:
        return app.stream(gen, answer.events(), headers)
    return await app.whole(request, gen, answer.whole(), headers)


async def retrieve(app: App, request: Request) -> Response:
    try:
        principal = app._authorize(request)
        stored = app.responses.get(request.path_params["response_id"], _owner(principal))
    except HttpError as exc:
        return exc.response()
    return JSONResponse(stored.response)


async def delete(app: App, request: Request) -> Response:
    try:
        principal = app._authorize(request)
        response_id = request.path_params["response_id"]
        app.responses.delete(response_id, _owner(principal))
    except HttpError as exc:
        return exc.response()
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


# ------------------------------------------------------------ the request
def to_chat(
    body: dict[str, Any], store: ResponseStore, owner: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completion body a Responses body means, and the conversation it continues
    (without the instructions, which a later response does not inherit)."""
    for name in UNBUILT:
        if body.get(name) is not None:
            raise bad_request(f"{name} is not supported", name)
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation must be 'disabled' (nothing is cut to fit)", "truncation")
    conversation: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise bad_request("previous_response_id must be a response id", "previous_response_id")
        conversation = list(store.get(previous, owner, "previous_response_id").conversation)
    conversation += input_messages(body.get("input"))
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in OWN}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a bool", "stream")
    chat["stream"] = stream
    tools = body.get("tools")
    if tools:  # an empty list, as agent SDKs send without tools, is none
        chat["tools"] = _tools(tools)
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    elif body.get("tool_choice") not in (None, "auto", "none"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad_request("text must be an object", "text")
        response_format = _format(text.get("format"))
        if response_format is not None:
            chat["response_format"] = response_format
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise bad_request("store must be a bool", "store")
    return chat, conversation


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of message, function_call and function_call_output
    items) as chat messages; consecutive function calls are one assistant message."""
    if isinstance(items, str):
        if not items:
            raise bad_request("input must not be empty", "input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"input[{i}].role must be user, system, developer or assistant", "input"
                )
            messages.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _string(item, "name", i),
                    "arguments": _string(item, "arguments", i, empty=True),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, i)
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": content}
            )
        elif kind == "reasoning":
            continue  # a reasoning model's notes: this engine's models write none
        else:
            raise bad_request(f"input[{i}].type {kind!r} is not supported", "input")
    return messages


def _string(item: dict[str, Any], name: str, i: int, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise bad_request(f"input[{i}].{name} must be a string", "input")
    return value


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(
                f"input[{i}].content: {kind!r} parts are not supported (text only)", "input"
            )
        texts.append(part.get("text") if kind != "refusal" else part.get("refusal"))
    if not all(isinstance(t, str) for t in texts):
        raise bad_request(f"input[{i}].content: a text part without its text", "input")
    return "\n".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: {kind!r} tools are not supported (functions only)")
        function = {"name": tool.get("name")}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(
        "tool_choice must be auto, none, required or {type: function, name}", "tool_choice"
    )


def _format(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": spec.get("name") or "answer", "schema": spec.get("schema")}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request("text.format.type must be text, json_object or json_schema", "text")


# ------------------------------------------------------------- the answer
class ResponseAnswer:
    """One response: its output items, whole or streamed, and its place in the store."""

    def __init__(
        self,
        app: App,
        gen: OpenAIGeneration,
        body: dict[str, Any],
        conversation: list[dict[str, Any]],
        owner: str,
    ) -> None:
        self.app, self.gen, self.body = app, gen, body
        self.conversation, self.owner = conversation, owner
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex
        self.sequence = 0

    def response(self, status: str, output: list[dict[str, Any]], usage: dict | None) -> dict:
        body, sub = self.body, self.gen.sub
        reason = None
        if status == "incomplete":
            reason = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": reason,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": sub.model,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": body.get("store", True),
            "metadata": body.get("metadata") or {},
            "usage": usage,
        }

    def _usage(self, output_tokens: int) -> dict[str, Any]:
        gen = self.gen
        return {
            "input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + output_tokens,
        }

    def _items(self, content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if content:
            items.append(self._message(content, "completed"))
        items += [self._call(call) for call in calls]
        return items

    def _message(self, text: str, status: str) -> dict[str, Any]:
        parts = [{"type": "output_text", "text": text, "annotations": []}] if text else []
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": parts,
        }

    @staticmethod
    def _call(call: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }

    def _finish(self, content: str | None, calls: list, tokens: int, reason: str | None) -> dict:
        """The completed response, stored if asked."""
        status = "incomplete" if reason == "length" and not calls else "completed"
        done = self.response(status, self._items(content, calls), self._usage(tokens))
        if self.body.get("store", True):
            said: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                said["tool_calls"] = calls
            self.app.responses.put(self.id, Stored(done, [*self.conversation, said], self.owner))
        return done

    async def whole(self) -> dict[str, Any]:
        chat = await self.gen.complete()
        choice = chat["choices"][0]
        message = choice["message"]
        reason = choice["finish_reason"]
        calls = message.get("tool_calls") or []
        return self._finish(
            message.get("content"), calls, chat["usage"]["completion_tokens"], reason
        )

    # ----------------------------------------------------------- streaming
    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """response.created, in_progress; the message's text as it comes (output_item.added,
        content_part.added, output_text.delta ..., then their .done); each function call
        (output_item.added, function_call_arguments.delta and .done, output_item.done);
        response.completed."""
        gen = self.gen
        yield self._event("response.created", response=self.response("in_progress", [], None))
        yield self._event("response.in_progress", response=self.response("in_progress", [], None))
        tools = gen.sub.tools
        held = ToolStream(tools) if tools is not None else None
        text, tokens, reason, opened = "", 0, None, False
        try:
            async for _, delta in gen.deltas():
                tokens += len(delta.token_ids)
                sendable = held.push(delta.text) if held is not None else delta.text
                if sendable:
                    if not opened:
                        opened = True
                        for event in self._open_message():
                            yield event
                    text += sendable
                    yield self._event(
                        "response.output_text.delta",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        delta=sendable,
                        logprobs=[],
                    )
                if delta.finished:
                    reason = finish_reason(delta.finish_reason)
        except HttpError as exc:
            yield self._event("error", code=exc.code, message=exc.message, param=exc.param)
            return
        calls: list[dict[str, Any]] = []
        if held is not None:
            rest, calls = held.finish()
            if rest:
                if not opened:
                    opened = True
                    for event in self._open_message():
                        yield event
                text += rest
                yield self._event(
                    "response.output_text.delta",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    delta=rest,
                    logprobs=[],
                )
        if opened:
            for event in self._close_message(text):
                yield event
        first = 1 if opened else 0
        for index, call in enumerate(calls, first):
            item = self._call(call)
            yield self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            yield self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
            yield self._event("response.output_item.done", output_index=index, item=item)
        done = self._finish(text or None, calls, tokens, reason)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=done)

    def _open_message(self) -> list[str]:
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=self._message("", "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            ),
        ]

    def _close_message(self, text: str) -> list[str]:
        part = {"type": "output_text", "text": text, "annotations": []}
        return [
            self._event(
                "response.output_text.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
            self._event(
                "response.output_item.done",
                output_index=0,
                item=self._message(text, "completed"),
            ),
        ]
