"""OpenAI request bodies -> the engine's inputs; engine outputs -> OpenAI response fields.

Bodies are read as plain JSON and checked here field by field, so that every bad value
gets a 400 naming its field (SamplingParams does the range checks and names the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from async_engine.core.chat import normalize_messages
from async_engine.core.request import FinishReason
from async_engine.server.codec import Limits
from async_engine.server.http.errors import bad_request
from async_engine.server.http.tools import ToolSpec, tool_spec
from sampler.params import FIELDS, MAX_LOGPROBS, SamplingParams

DEFAULT_LIMITS = Limits()
JSON_OBJECT = json.dumps({"type": "object", "additionalProperties": True})


@dataclass(slots=True)
class HttpSubmission:
    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    user: str
    top_logprobs: int | None  # chat: top-n per token when logprobs were asked for
    tools: ToolSpec | None = None  # chat: tool calls constrained to the tools' schemas
    priority: int | None = None  # vLLM's extension; lower runs sooner (None: the default)


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int to Python, but `max_tokens: true` is a client bug, not 1.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad_request(f"{name} must be {' or '.join(k.__name__ for k in kinds)}", name)
    return value


def _stop(body: dict[str, Any], limits: Limits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    most = limits.max_stop_strings
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) for s in stops)
        or (len(stops) > most)
    ):
        raise bad_request(f"stop must be a string or a list of at most {most} strings", "stop")
    if sum(len(s) for s in stops) > limits.max_stop_chars:
        raise bad_request(
            f"stop strings are longer than {limits.max_stop_chars} characters", "stop"
        )
    return tuple(stops)


def structured_output(
    body: dict[str, Any], limits: Limits = DEFAULT_LIMITS
) -> tuple[str, str] | None:
    """``response_format`` (json_object, json_schema), or the ``guided_regex`` and
    ``guided_grammar`` extensions; at most one of them, no longer than the limit (compiling
    takes time in proportion)."""
    found: list[tuple[str, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise bad_request(
                "response_format type must be text, json_object or json_schema", "response_format"
            )
        if fmt["type"] == "json_object":
            # A JSON object, as OpenAI's json_object promises (the "json" kind takes any value).
            found.append(("json_schema", JSON_OBJECT))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(
                    "response_format.json_schema.schema must be an object", "response_format"
                )
            found.append(("json_schema", json.dumps(schema)))
    fields = ["response_format"] * len(found)
    for name, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            found.append((kind, _get(body, name, (str,))))
            fields.append(name)
    if len(found) > 1:
        raise bad_request(
            "give one of response_format, guided_regex, guided_grammar", "response_format"
        )
    if found and len(found[0][1]) > limits.max_structured_chars:
        raise bad_request(
            f"{fields[0]} is longer than {limits.max_structured_chars} characters", fields[0]
        )
    return found[0] if found else None


def _params(
    body: dict[str, Any],
    max_tokens: int | None,
    logprobs: int | None,
    structured: tuple[str, str] | None,
    limits: Limits,
) -> SamplingParams:
    # The fields HTTP parses itself (per endpoint, or bounded by the server's limits) ...
    values: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stop": _stop(body, limits),
        "logprobs": logprobs,
        "structured_output": structured,
    }
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {n}", "n")
    values["stop_token_ids"] = _stop_token_ids(body, limits)
    # ... and every other one it offers, as given (SamplingParams checks it and names it).
    as_given = {s.name: s.http for s in FIELDS if s.http is not None and s.name not in values}
    for name, key in as_given.items():
        if body.get(key) is not None:
            values[name] = body[key]
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        err = bad_request(str(exc))
        # The error names the engine's field; a field HTTP spells otherwise, by its key.
        err.param = as_given.get(err.param or "", err.param)
        raise err from None


def _stop_token_ids(body: dict[str, Any], limits: Limits) -> tuple[int, ...]:
    stop_ids = body.get("stop_token_ids")  # vLLM's extension
    if stop_ids is None:
        return ()
    if not isinstance(stop_ids, list):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
    if len(stop_ids) > limits.max_stop_token_ids:
        raise bad_request(
            f"stop_token_ids has more than {limits.max_stop_token_ids} ids", "stop_token_ids"
        )
    return tuple(stop_ids)


def _refuse_unbuilt(body: dict[str, Any]) -> None:
    """Fields that would change the answer if ignored (an eval harness reading prompt
    scores would silently score 0): a 400 naming each until it is built."""
    if body.get("echo"):
        raise bad_request("echo is not supported yet (no prompt logprobs)", "echo")
    if body.get("prompt_logprobs") is not None:
        raise bad_request("prompt_logprobs is not supported yet", "prompt_logprobs")
    if body.get("suffix"):
        raise bad_request("suffix (insertion) is not supported", "suffix")
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and best_of != (1 if n is None else n):
        raise bad_request("best_of is not supported unless it equals n", "best_of")


def _common(body: dict[str, Any]) -> tuple[str, bool, bool, str]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    _refuse_unbuilt(body)
    model = _get(body, "model", (str,), "")
    if not model:
        raise bad_request("model is required", "model")
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    include_usage = bool(options.get("include_usage", False))
    user = _get(body, "user", (str,), "")
    return model, stream, include_usage, user


def completion_request(body: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HttpSubmission:
    model, stream, include_usage, user = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise bad_request("prompt must be a string or a list of token ids (one prompt)", "prompt")
    if not isinstance(prompt, (str, list)) or not prompt:
        raise bad_request("prompt must be a non-empty string or list of token ids", "prompt")
    if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
        raise bad_request(f"prompt is longer than {limits.max_prompt_chars} characters", "prompt")
    if isinstance(prompt, list) and len(prompt) > limits.max_prompt_tokens:
        raise bad_request(f"prompt has more than {limits.max_prompt_tokens} token ids", "prompt")
    max_tokens = _get(body, "max_tokens", (int,), 16)
    logprobs = _get(body, "logprobs", (int,), None)
    params = _params(body, max_tokens, logprobs, structured_output(body, limits), limits)
    sub = HttpSubmission(model, prompt, None, params, stream, include_usage, user, None)
    sub.priority = _priority(body)
    return sub


def _priority(body: dict[str, Any]) -> int | None:
    priority = _get(body, "priority", (int,), None)
    if priority is not None and not -(2**31) <= priority < 2**31:
        raise bad_request("priority must be a 32-bit integer", "priority")
    return priority


def chat_request(body: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HttpSubmission:
    model, stream, include_usage, user = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if len(messages) > limits.max_messages:
        raise bad_request(f"messages has more than {limits.max_messages} entries", "messages")
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise bad_request(
                f"{old} is the deprecated form of tools: give tools and tool_choice", old
            )
    try:
        messages = normalize_messages(messages)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    chars = sum(len(m.get("content") or "") for m in messages)
    if chars > limits.max_prompt_chars:
        raise bad_request(
            f"messages are longer than {limits.max_prompt_chars} characters", "messages"
        )
    max_tokens = _get(body, "max_completion_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), None)
    wants = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), None)
    if top is not None and not wants:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}", "top_logprobs"
        )
    structured = structured_output(body, limits)
    if len(json.dumps(body.get("tools") or [])) > limits.max_structured_chars:
        raise bad_request(
            f"tools are longer than {limits.max_structured_chars} characters "
            "(their grammar is compiled per request)",
            "tools",
        )
    tools = tool_spec(body, structured)
    if tools is not None:
        structured = tools.schema_output()
    params = _params(body, max_tokens, (top or 0) if wants else None, structured, limits)
    sub = HttpSubmission(model, None, messages, params, stream, include_usage, user, top)
    sub.tools = tools
    sub.priority = _priority(body)
    return sub


def finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return {FinishReason.LENGTH: "length", FinishReason.CONTEXT_LENGTH: "length"}.get(
        reason, "stop" if reason in (FinishReason.EOS, FinishReason.STOP) else "abort"
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
