"""OpenAI request bodies -> the engine's inputs; engine outputs -> OpenAI response fields.

Bodies are read as plain JSON and checked here field by field, so that every bad value
gets a 400 naming its field (SamplingParams does the range checks and names the field).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from async_engine.core.chat import normalize_messages
from async_engine.core.request import FinishReason
from async_engine.server.codec import Limits
from async_engine.server.http.errors import bad_request
from async_engine.server.http.tools import ToolSpec, tool_spec
from sampler.params import FIELDS, MAX_LOGPROBS, SamplingParams

DEFAULT_LIMITS = Limits()
MAX_CHOICES = 256  # a completion's prompts times n
JSON_OBJECT = json.dumps({"type": "object", "additionalProperties": True})


@dataclass(slots=True)
class HttpSubmission:
    model: str
    # A completion's prompts (a batch: prompt i's n choices are i*n..i*n+n-1); a chat's
    # one prompt once it is templated, none before.
    prompts: list[str | list[int]]
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    user: str
    top_logprobs: int | None  # chat: top-n per token when logprobs were asked for
    tools: ToolSpec | None = None  # chat: tool calls constrained to the tools' schemas
    priority: int | None = None  # vLLM's extension; lower runs sooner (None: the default)
    # stream_options.continuous_usage_stats: every chunk carries the usage so far.
    continuous_usage: bool = False
    # Completions: echo the prompt before each choice (its tokens' logprobs first, where
    # logprobs are asked); score_only: max_tokens 0, nothing generated is shown.
    echo: bool = False
    score_only: bool = False
    originals: list[str | list[int]] = field(default_factory=list)  # prompts as sent
    show_prompt_logprobs: bool = False  # vLLM's prompt_logprobs extension was asked for


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
    """Fields that would change the answer if ignored: a 400 naming each until it is built."""
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
    for name in ("include_usage", "continuous_usage_stats"):
        if not isinstance(options.get(name, False), bool):
            raise bad_request(f"stream_options.{name} must be a bool", "stream_options")
    include_usage = options.get("include_usage", False)
    user = _get(body, "user", (str,), "")
    return model, stream, include_usage, user


def completion_request(body: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HttpSubmission:
    model, stream, include_usage, user = _common(body)
    prompts = _prompts(body.get("prompt"), limits)
    max_tokens = _get(body, "max_tokens", (int,), 16)
    logprobs = _get(body, "logprobs", (int,), None)
    echo = _get(body, "echo", (bool,), False)
    score_only = max_tokens == 0
    if score_only and not echo:
        raise bad_request("max_tokens 0 (score the prompt only) needs echo: true", "max_tokens")
    if score_only:
        max_tokens = 1  # the prompt's last logits sample one token anyway: it is dropped
    params = _params(body, max_tokens, logprobs, structured_output(body, limits), limits)
    if echo and logprobs is not None:  # logprobs then cover the prompt's tokens too
        wanted = max(params.prompt_logprobs or 0, logprobs)
        params = dataclasses.replace(params, prompt_logprobs=wanted)
    if len(prompts) * params.n > MAX_CHOICES:
        raise bad_request(
            f"prompt: {len(prompts)} prompts of n={params.n} are more than {MAX_CHOICES} choices",
            "prompt",
        )
    sub = HttpSubmission(model, prompts, None, params, stream, include_usage, user, None)
    sub.priority = _priority(body)
    sub.continuous_usage = _continuous_usage(body)
    sub.echo, sub.score_only = echo, score_only
    sub.show_prompt_logprobs = body.get("prompt_logprobs") is not None
    sub.originals = list(prompts)
    return sub


def _continuous_usage(body: dict[str, Any]) -> bool:
    """Taken on its own too (vLLM wants include_usage beside it and else ignores it)."""
    return bool((body.get("stream_options") or {}).get("continuous_usage_stats", False))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(prompt: Any, limits: Limits) -> list[str | list[int]]:
    """``prompt`` as OpenAI takes it: a string, token ids, or a batch of either."""
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    ):
        prompts = prompt
    else:
        raise bad_request(
            "prompt must be a string, a list of token ids, or a list of either (a batch)",
            "prompt",
        )
    if not all(prompts):
        raise bad_request("prompt must not be empty (nor any prompt of a batch)", "prompt")
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    if chars > limits.max_prompt_chars:
        raise bad_request(f"prompt is longer than {limits.max_prompt_chars} characters", "prompt")
    ids = sum(len(p) for p in prompts if isinstance(p, list))
    if ids > limits.max_prompt_tokens:
        raise bad_request(f"prompt has more than {limits.max_prompt_tokens} token ids", "prompt")
    return prompts


def _priority(body: dict[str, Any]) -> int | None:
    priority = _get(body, "priority", (int,), None)
    if priority is not None and not -(2**31) <= priority < 2**31:
        raise bad_request("priority must be a 32-bit integer", "priority")
    return priority


def chat_request(body: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> HttpSubmission:
    model, stream, include_usage, user = _common(body)
    if body.get("echo"):
        raise bad_request("echo is not supported in chat completions", "echo")
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
    sub = HttpSubmission(model, [], messages, params, stream, include_usage, user, top)
    sub.tools = tools
    sub.priority = _priority(body)
    sub.continuous_usage = _continuous_usage(body)
    sub.show_prompt_logprobs = body.get("prompt_logprobs") is not None
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
