"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the server's own token counts and
spellings, for benchmark and eval tools that count tokens as the server does.

``/tokenize`` takes a ``prompt`` (tokenized as a completion's is, ``add_special_tokens``
true by default) or ``messages`` (through the chat template, with ``tools`` and
``add_generation_prompt``, ``add_special_tokens`` false by default: the template writes its
own) and answers ``count``, ``max_model_len``, ``tokens`` and, with ``return_token_strs``,
each token's vocabulary entry. ``/detokenize`` takes ``tokens`` and answers ``prompt``, its
text with special tokens kept. Bodies meet the same limits as every other body.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from async_engine.core.chat import normalize_messages
from async_engine.core.tokenizer import Tokenizer
from async_engine.server.http.errors import HttpError, bad_request
from async_engine.server.http.protocol import _get
from async_engine.server.http.render import OpenAIApp
from async_engine.server.http.tools import tool_spec


async def tokenize(app: OpenAIApp, request: Request) -> Response:
    try:
        body = await _body(app, request)
        tokenizer = _tokenizer(app)
        limits = app.state.limits
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        as_strings = _get(body, "return_token_strs", (bool,), False)
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise bad_request("prompt must be a non-empty string", "prompt")
            if len(prompt) > limits.max_prompt_chars:
                raise bad_request(
                    f"prompt is longer than {limits.max_prompt_chars} characters", "prompt"
                )
            special = _get(body, "add_special_tokens", (bool,), True)
            ids = await asyncio.to_thread(tokenizer.encode, prompt, special)
        else:
            ids = await _chat_ids(app, tokenizer, body, messages)
    except HttpError as exc:
        return exc.response()
    strings = tokenizer.hf.convert_ids_to_tokens(ids) if as_strings else None
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": app.engine.max_model_len,
            "tokens": ids,
            "token_strs": strings,
        }
    )


async def detokenize(app: OpenAIApp, request: Request) -> Response:
    try:
        body = await _body(app, request)
        tokenizer = _tokenizer(app)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("tokens must be a list of token ids", "tokens")
        most = app.state.limits.max_prompt_tokens
        if len(tokens) > most:
            raise bad_request(f"tokens has more than {most} token ids", "tokens")
        bad = next((t for t in tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"tokens: {bad} is not a token id (the vocabulary has {tokenizer.vocab_size})",
                "tokens",
            )
        text = await asyncio.to_thread(tokenizer.decode, tokens, False)
    except HttpError as exc:
        return exc.response()
    return JSONResponse({"prompt": text})


async def _body(app: OpenAIApp, request: Request) -> dict[str, Any]:
    app._authorize(request)
    body, _ = await app._json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    model = _get(body, "model", (str,), "")
    if model and model not in app.model_names:
        raise HttpError(404, f"model {model!r} is not served here", "model", "model_not_found")
    return body


def _tokenizer(app: OpenAIApp) -> Tokenizer:
    if app.engine.tokenizer is None:
        raise bad_request("this model has no tokenizer", None)
    return app.engine.tokenizer


async def _chat_ids(
    app: OpenAIApp, tokenizer: Tokenizer, body: dict[str, Any], messages: Any
) -> list[int]:
    limits = app.state.limits
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if len(messages) > limits.max_messages:
        raise bad_request(f"messages has more than {limits.max_messages} entries", "messages")
    try:
        messages = normalize_messages(messages)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    if sum(len(m.get("content") or "") for m in messages) > limits.max_prompt_chars:
        raise bad_request(
            f"messages are longer than {limits.max_prompt_chars} characters", "messages"
        )
    if len(json.dumps(body.get("tools") or [])) > limits.max_structured_chars:
        raise bad_request(f"tools are longer than {limits.max_structured_chars} characters")
    spec = await asyncio.to_thread(tool_spec, body, None)  # checks each tool's schema
    tools = spec.tools if spec is not None else None
    generation_prompt = _get(body, "add_generation_prompt", (bool,), True)
    special = _get(body, "add_special_tokens", (bool,), False)
    try:
        return await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, tools, generation_prompt, special
        )
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
