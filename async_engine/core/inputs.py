"""Turn what a caller submits into a validated Request, or raise ValueError naming the field."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any

from async_engine.core.request import Request
from async_engine.core.tokenizer import Tokenizer
from sampler.params import SamplingParams


class DuplicateRequestError(ValueError):
    """request_id is already in flight."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; try again later."""


@dataclass(slots=True)
class InputLimits:
    vocab_size: int
    max_model_len: int
    max_prompt_blocks: int  # the whole KV pool: a prompt larger than it can never run
    block_size: int
    eos_ids: tuple[int, ...]


class InputBuilder:
    def __init__(self, limits: InputLimits, tokenizer: Tokenizer | None) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self._arrivals = itertools.count()

    def build(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None,
        *,
        request_id: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        priority: int = 0,
        tenant: str = "",
        truncate_prompt: bool = False,
        max_queue_ms: int | None = None,
        time_limit_ms: int | None = None,
    ) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if tools is not None and messages is None:
            raise ValueError("tools: only a chat (messages) request takes tools")
        ids = self._prompt_ids(prompt, messages, tools, truncate_prompt)
        ids = self._fit_context(ids, params, truncate_prompt)
        for t in params.stop_token_ids:
            if t >= self.limits.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary")
        rid = request_id if request_id else uuid.uuid4().hex
        if not isinstance(rid, str):
            raise ValueError(f"request_id must be a string, got {type(rid).__name__}")
        for name, value in (("max_queue_ms", max_queue_ms), ("time_limit_ms", time_limit_ms)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        req = Request(
            rid,
            ids,
            params,
            max_model_len=self.limits.max_model_len,
            eos_ids=self.limits.eos_ids,
            priority=priority,
            tenant=tenant,
            arrival_seq=next(self._arrivals),
        )
        if max_queue_ms is not None:
            req.queue_deadline = req.arrival_time + max_queue_ms / 1000
        if time_limit_ms is not None:
            req.time_deadline = req.arrival_time + time_limit_ms / 1000
        return req

    def check_text_fits(self, text: str, truncate: bool = False) -> None:
        """Refuse, before tokenizing, text too long for the context whatever its tokens."""
        _check_unicode(text, "prompt")
        fits = self.limits.max_model_len * self._need_tokenizer("prompt").max_token_chars
        if len(text) > fits and not truncate:
            raise ValueError(
                f"prompt: {len(text)} characters cannot fit the context of "
                f"{self.limits.max_model_len} tokens (refused before tokenizing)"
            )

    def check_chat_fits(self, messages: Any) -> None:
        """Refuse, before templating, a conversation whose text alone cannot fit the context
        (the template only adds to it)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        chars = sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
        fits = self.limits.max_model_len * self._need_tokenizer("messages").max_token_chars
        if chars > fits:
            raise ValueError(
                f"messages: {chars} characters of content cannot fit the context "
                f"of {self.limits.max_model_len} tokens (refused before "
                "templating)"
            )
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                _check_unicode(m["content"], f"messages[{i}].content")

    def chat_ids(self, messages: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation templated and tokenized, once ``check_chat_fits`` passed: slow for
        a long chat, so servers call it off the event loop (``AsyncEngine.prepare``)."""
        return self._need_tokenizer("messages").apply_chat_template(messages, tools)

    def _prompt_ids(
        self,
        prompt: Any,
        messages: list[dict[str, Any]] | None,
        tools: list[dict[str, Any]] | None = None,
        truncate: bool = False,
    ) -> list[int]:
        if messages is not None:
            if prompt is not None:
                raise ValueError("prompt: give either a prompt or messages, not both")
            self.check_chat_fits(messages)
            return self.chat_ids(messages, tools)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            self.check_text_fits(prompt, truncate)
            ids = self._need_tokenizer("prompt").encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r:.80}")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.limits.vocab_size
        # In C first (a 1,024-prompt batch spent 24 us a prompt checking id by id); the
        # slow loop only names the bad id.
        if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab:
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(
                        f"prompt: token id {t!r} is outside the vocabulary [0, {vocab})"
                    )
        return ids

    def _fit_context(self, ids: list[int], params: SamplingParams, truncate: bool) -> list[int]:
        limit = self.limits.max_model_len
        room = limit - (params.max_tokens or 1)
        if len(ids) > room:
            if not truncate or room < 1:
                raise ValueError(
                    f"max_tokens: prompt ({len(ids)} tokens) plus max_tokens "
                    f"({params.max_tokens}) exceeds the context length {limit}"
                )
            ids = ids[-room:]  # keep the end, where the question usually is
        # A request must fit the whole KV pool on its own at its longest, or it could be
        # preempted forever; without max_tokens it may grow to the context length.
        capacity = self.limits.max_prompt_blocks * self.limits.block_size
        longest = len(ids) + params.max_tokens if params.max_tokens is not None else limit
        if longest > capacity:
            raise ValueError(
                f"max_tokens: prompt ({len(ids)} tokens) plus max_tokens "
                f"({params.max_tokens}) cannot fit the KV cache ({capacity} tokens); "
                "lower max_tokens or raise num_kv_blocks"
            )
        return ids

    def _need_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model has no tokenizer; pass token ids")
        return self.tokenizer


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: only text counts toward the bound
        return sum(
            len(p["text"])
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return 0


def _check_unicode(text: str, field: str) -> None:
    """A lone UTF-16 surrogate ("\\ud800") is a Python string but no text a tokenizer takes."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} is not valid Unicode: {exc.reason} at {exc.start}") from None
