"""vLLM's render endpoints: a prompt's token ids as this engine computes them, nothing
generated (``POST /v1/completions/render`` answers a list, one per prompt of a batch, the
chat one an object).

vllm-router's ``kv_aware`` policy does not tokenize for HTTP workers: it asks a worker to
render each text or chat request, then looks the ids up in the workers' KV events. Without
these endpoints it credits such a request no cached prefix at all.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from async_engine.core.engine import AsyncEngine
from async_engine.server.auth import Principal
from async_engine.server.http.errors import HttpError, bad_request
from async_engine.server.http.protocol import chat_request, completion_request
from async_engine.server.state import ServingState


class OpenAIApp(Protocol):
    """What rendering needs of the HTTP app (named here: the app imports this module)."""

    engine: AsyncEngine
    state: ServingState
    model_names: set[str]

    def _authorize(self, request: Request) -> Principal | None: ...

    async def _json(self, request: Request) -> tuple[Any, int]: ...


async def render(app: OpenAIApp, request: Request, chat: bool) -> Response:
    try:
        app._authorize(request)
        body, _ = await app._json(request)
        sub = await asyncio.to_thread(
            chat_request if chat else completion_request, body, app.state.limits
        )
        if sub.model not in app.model_names:
            raise HttpError(
                404, f"model {sub.model!r} is not served here", "model", "model_not_found"
            )
        tools = sub.tools.tools if sub.tools and sub.tools.choice != "none" else None
        try:
            if chat:
                batch = [await prompt_ids(app, None, sub.messages, tools)]
            else:
                batch = [await prompt_ids(app, p, None, None) for p in sub.prompts]
        except ValueError as exc:
            raise bad_request(str(exc), "messages" if chat else "prompt") from None
    except HttpError as exc:
        return exc.response()
    rendered = [
        {
            "request_id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "model": sub.model,
            "token_ids": ids,
            "sampling_params": {"max_tokens": sub.params.max_tokens},
        }
        for ids in batch
    ]
    return JSONResponse(rendered[0] if chat else rendered)


async def prompt_ids(
    app: OpenAIApp,
    prompt: str | list[int] | None,
    messages: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    """The ids a submission of this prompt or chat would run: templated and tokenized as
    ``AsyncEngine.prepare`` and the intake do, off the loop."""
    engine = app.engine
    prepared = await engine.prepare(prompt, None, messages, tools)
    if isinstance(prepared, list):
        return prepared
    if engine.tokenizer is None:
        raise ValueError("prompt: this model has no tokenizer: send token ids")
    if not prepared:
        raise ValueError("prompt is empty")
    return await asyncio.to_thread(engine.tokenizer.encode, prepared)
