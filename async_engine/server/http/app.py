"""The OpenAI-compatible HTTP API: a Starlette app on uvicorn, in the gRPC server's loop.

Starlette rather than FastAPI: bodies are checked field by field in ``protocol`` (every bad
value a 400 in OpenAI's error shape naming its field), so a pydantic layer would only
validate twice and answer 422s in another shape. The same engine serves both APIs.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from async_engine.core.supervisor import DeviceState
from async_engine.server.auth import NotAllowed, Principal
from async_engine.server.codec import Limits
from async_engine.server.http import responses
from async_engine.server.http.errors import HttpError, bad_request
from async_engine.server.http.generate import OpenAIGeneration
from async_engine.server.http.protocol import HttpSubmission, chat_request, completion_request
from async_engine.server.http.render import render
from async_engine.server.http.tokenize import detokenize, tokenize
from async_engine.server.stalls import StalledStreams
from async_engine.server.state import ServingState

log = structlog.get_logger("async_engine.server.http")
# JSON can carry a surrogate code point only as a \uD800-\uDFFF escape, or as the CESU-8
# bytes json.loads lets through (ED A0..BF): Python strings hold it, no tokenizer takes it.
JSON_TYPES = ("application/json", "*/*", "")  # no Content-Type at all is taken as JSON
OFF_LOOP_BYTES = 64 << 10  # bodies this big are parsed on a worker thread
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89abAB]|\xed[\xa0-\xbf]")


class OpenAIApp:
    def __init__(
        self, state: ServingState, max_body_bytes: int = 4 << 20, body_timeout_s: float = 30.0
    ) -> None:
        self.state = state
        self.engine = state.engine
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.model_names = {"default", str(self.engine.config.model)}
        self.created = int(time.time())  # the model card's: when this server began serving
        self.responses = responses.ResponseStore()
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route(
                    "/v1/completions/render", partial(render, self, chat=False), methods=["POST"]
                ),
                Route(
                    "/v1/chat/completions/render",
                    partial(render, self, chat=True),
                    methods=["POST"],
                ),
                Route("/v1/responses", partial(responses.create, self), methods=["POST"]),
                Route(
                    "/v1/responses/{response_id}",
                    partial(responses.retrieve, self),
                    methods=["GET"],
                ),
                Route(
                    "/v1/responses/{response_id}",
                    partial(responses.delete, self),
                    methods=["DELETE"],
                ),
                Route("/tokenize", partial(tokenize, self), methods=["POST"]),
                Route("/detokenize", partial(detokenize, self), methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/get_load", self.get_load, methods=["GET"]),
                Route("/get_server_info", self.server_info, methods=["GET"]),
                Route("/kv_event_sources", self.kv_event_sources, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_exception},
        )

    # ------------------------------------------------------------ endpoints
    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except HttpError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        try:
            self._authorize(request)
            name = request.path_params["model"]
            if name not in self.model_names:
                raise HttpError(
                    404, f"model {name!r} is not served here", "model", "model_not_found"
                )
        except HttpError as exc:
            return exc.response()
        return JSONResponse(self._card())

    def _card(self) -> dict[str, Any]:
        return {
            "id": str(self.engine.config.model),
            "object": "model",
            "created": self.created,
            "owned_by": "async-engine",
            "max_model_len": self.engine.max_model_len,
        }

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def health(self, request: Request) -> Response:
        state = self.state
        if state.draining or state.warming or self.engine.device_state is not DeviceState.SERVING:
            return PlainTextResponse("not serving", status_code=503)
        return PlainTextResponse("ok")

    async def metrics(self, request: Request) -> Response:
        # On the engine's loop, so the gauges can be read now rather than up to a refresh
        # interval ago (the separate metrics port's thread cannot read the engine).
        try:
            self.state.metrics.refresh(self.engine)
        except Exception:  # a metrics bug must not hide the metrics: serve the last values
            log.exception("metrics.refresh_failed")
        body = generate_latest(self.state.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def get_load(self, request: Request) -> Response:
        """What vllm-router's power-of-two policy polls; unauthenticated, as /metrics is."""
        return JSONResponse({"load": self.state.load()})

    async def server_info(self, request: Request) -> Response:
        """What a KV-aware router reads on meeting a worker: the model its KV events belong
        to and their block size. Only fields vllm-router knows: it refuses a body with a
        second name for one of them (``block_size`` beside ``kv_block_size``)."""
        config = self.engine.config
        model = str(config.model)
        return JSONResponse(
            {"model_id": model, "model_path": model, "kv_block_size": config.block_size}
        )

    async def kv_event_sources(self, request: Request) -> Response:
        """Where this server's KV events can be subscribed to, keyed by data-parallel rank
        (one here), as vllm-router discovers them. 404 where there is nothing to subscribe
        to: events off, or sent to an indexer that binds (a subscriber cannot connect)."""
        sources = self.engine.kv_events.sources()
        if sources is None:
            return HttpError(
                404, "this server publishes no KV events", None, "not_found"
            ).response()
        return JSONResponse(sources)

    # ---------------------------------------------------------- generation
    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            principal = self._admit(request)
            body, size = await self._json(request)
            parse = chat_request if chat else completion_request
            gen = await self.start(request, principal, body, size, parse, chat)
        except HttpError as exc:
            return exc.response()
        headers = {"x-request-id": gen.id}
        if gen.sub.stream:
            return self.stream(gen, gen.events(), headers)
        return await self.whole(request, gen, gen.complete(), headers)

    def stream(
        self, gen: OpenAIGeneration, events: AsyncIterator[str], headers: dict
    ) -> StreamingResponse:
        """Server-sent ``events``; the generation is released however the stream ends."""
        return StreamingResponse(
            _released(gen, events, self.state.stalls),
            media_type="text/event-stream",
            headers=headers,
        )

    def _admit(self, request: Request) -> Principal | None:
        """The caller (HttpError 401), if the server takes work (503) and JSON (415)."""
        principal = self._authorize(request)
        if self.state.draining:
            raise HttpError(503, "server is draining; retry on another replica")
        kind = request.headers.get("content-type", "application/json").split(";")[0]
        if kind.strip().lower() not in JSON_TYPES:
            raise HttpError(
                415,
                f"Content-Type must be application/json, got {kind[:64]!r}",
                None,
                "unsupported_media_type",
            )
        return principal

    async def start(
        self,
        request: Request,
        principal: Principal | None,
        body: Any,
        size: int,
        parse: Callable[[Any, Limits], HttpSubmission],
        chat: bool,
    ) -> OpenAIGeneration:
        """A parsed body's request, checked, templated and submitted (HttpError if not)."""
        limits = self.state.limits
        costly = isinstance(body, dict) and ("tools" in body or "response_format" in body)
        if size > OFF_LOOP_BYTES or costly:
            # Schema checks and long contents cost milliseconds: not on the shared loop.
            sub = await asyncio.to_thread(parse, body, limits)
        else:
            sub = parse(body, limits)
        sub.user = sub.user or request.headers.get("x-tenant", "")
        if len(sub.user) > limits.max_tenant_chars:
            raise bad_request(
                f"user (the tenant) is longer than {limits.max_tenant_chars} characters", "user"
            )
        if principal is not None:
            try:
                sub.user, sub.priority = principal.admit(sub.user, sub.priority)
            except NotAllowed as exc:
                field = "user" if exc.field == "tenant" else exc.field
                raise HttpError(403, str(exc), field, "permission_denied") from None
        if sub.model not in self.model_names:
            raise HttpError(
                404, f"model {sub.model!r} is not served here", "model", "model_not_found"
            )
        try:
            tools = sub.tools.tools if sub.tools and sub.tools.choice != "none" else None
            prepare = self.engine.prepare
            if sub.messages is not None:
                sub.prompts = [await prepare(None, sub.params, sub.messages, tools)]
                sub.messages = None  # templated off the loop: the prompt holds its ids
            else:
                sub.prompts = [await prepare(p, sub.params) for p in sub.prompts]
        except ValueError as exc:
            text = str(exc)
            field = "response_format" if text.startswith("structured_output") else "prompt"
            field = "messages" if text.startswith("messages") else field
            raise bad_request(text, field) from None
        request_id = request.headers.get("x-request-id")
        if request_id is not None and len(request_id) > limits.max_request_id_chars:
            raise bad_request(
                f"x-request-id is longer than {limits.max_request_id_chars} characters",
                "x-request-id",
            )
        if request_id is not None and not (request_id.isascii() and request_id.isprintable()):
            # Header bytes arrive as latin-1: anything else would be echoed garbled.
            raise bad_request("x-request-id must be printable ASCII", "x-request-id")
        gen = OpenAIGeneration(self.state, sub, chat, request_id, principal)
        gen.submit()
        return gen

    async def whole(
        self, request: Request, gen: OpenAIGeneration, body: Awaitable[Any], headers: dict
    ) -> Response:
        """``body`` (the generation's answer) in one response, unless the client leaves
        first: then its request is aborted at once, as a dropped stream's is."""
        answer = asyncio.ensure_future(body)
        client_left = asyncio.create_task(_disconnected(request.receive))
        try:
            await asyncio.wait((answer, client_left), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                client_left.result()  # an error waiting for the client is ours: raise it
                return Response(status_code=499)
            return JSONResponse(answer.result(), headers=headers)
        except HttpError as exc:
            return exc.response()
        finally:
            for task in (answer, client_left):
                task.cancel()
            await asyncio.gather(answer, client_left, return_exceptions=True)
            gen.release()

    async def _json(self, request: Request) -> tuple[Any, int]:
        """The body parsed, and its size in bytes."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise HttpError(413, f"request body over {self.max_body_bytes} bytes")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):  # a body that never ends
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise HttpError(413, f"request body over {self.max_body_bytes} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise HttpError(
                408,
                f"the request body did not arrive within {self.body_timeout_s} s",
                None,
                "request_timeout",
            ) from None
        raw = b"".join(chunks)
        if len(raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(_parse_json, raw), len(raw)
        return _parse_json(raw), len(raw)

    def _authorize(self, request: Request) -> Principal | None:
        """The caller's principal (None without auth); HttpError 401 for a bad token."""
        if self.state.principals is None:
            return None
        principal = self.state.principals.lookup(request.headers.get("authorization"))
        if principal is None:
            raise HttpError(401, "missing or wrong bearer token", None, "invalid_api_key")
        return principal


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, a method the route does not take) in
    OpenAI's error shape, as every other error."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = f"{request.method} {request.url.path}: {exc.detail if isinstance(exc, HTTPException) else exc}"
    response = HttpError(status, message, None, codes.get(status)).response()
    if isinstance(exc, HTTPException) and exc.headers:
        response.headers.update(exc.headers)  # Allow, for a 405
    return response


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request's body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _released(
    gen: OpenAIGeneration, events: AsyncIterator[str], stalls: StalledStreams
) -> AsyncIterator[str]:
    """The stream's events; its requests are released however the stream ends (a client
    that stops reading included: its stalled write is cancelled)."""
    try:
        async for event in events:
            with stalls.write():
                yield event
    except HttpError as exc:  # after the 200 went out: report in-band, as OpenAI does
        yield f"data: {json.dumps({'error': {'message': exc.message, 'code': exc.code}})}\n\n"
    finally:
        gen.release()


def _parse_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request("the body nests too deeply", None) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None) from None
    if _MAY_HOLD_SURROGATE.search(raw):  # rare: only then pay for a second pass
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise bad_request(
                "the body holds a lone UTF-16 surrogate: a string that is not valid Unicode", None
            ) from None
    return body
