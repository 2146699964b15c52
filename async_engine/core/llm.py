"""LLM: the offline, synchronous API over AsyncEngine.

The engine's event loop runs on a private thread, so ``LLM`` works from plain scripts,
from notebooks that already run a loop, and from several instances one after another.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from async_engine.core.config import EngineConfig
from async_engine.core.engine import AsyncEngine
from async_engine.core.group import RequestGroup, RequestOptions, submit
from async_engine.core.output import RequestDelta
from async_engine.core.request import PromptScore, Request
from async_engine.core.stats import EngineStats
from async_engine.core.tokenizer import decode_continuation
from sampler.params import SamplingParams
from streams.device import Device

Prompt = str | list[int]
# Requests queued per turn of the event loop: between turns the engine plans and launches
# steps, so a large batch starts on the device before the last request is queued.
SUBMIT_BETWEEN_STEPS = 16


@dataclass(slots=True)
class CompletionOutput:
    """One of the n samples of a request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's result; the top-level fields are sample 0's, ``outputs`` holds all n."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With prompt_logprobs: per prompt token, None for the first, then {token id: logprob}
    # holding the prompt token and the top-n at its position (vLLM's shape, floats).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: list[CompletionOutput] = field(default_factory=list)


def prompt_logprob_dicts(
    prompt_ids: list[int], scores: list[PromptScore | None]
) -> list[dict[int, float] | None]:
    out: list[dict[int, float] | None] = []
    for token, score in zip(prompt_ids, scores, strict=True):
        if score is None:
            out.append(None)
            continue
        logprob, _, top = score
        entry = {token: logprob}
        entry.update((t, v) for t, v in top if t != token)
        out.append(entry)
    return out


class _LoopThread:
    def __init__(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="llm-loop")
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


def _close(engine: AsyncEngine, runner: _LoopThread) -> None:
    if runner.loop.is_running():
        try:
            runner.run(engine.aclose())
        except Exception:  # closing must not raise at interpreter exit
            engine.close()
    else:
        engine.close()
    runner.stop()


class LLM:
    def __init__(
        self,
        model: str = "default",
        dtype: str = "auto",
        device: str = "auto",
        overlap: bool = True,
        *,
        device_wrapper: Callable[[Device], Device] | None = None,
        **engine_options: Any,
    ) -> None:
        """``device_wrapper`` wraps the engine's device, an injection point (tests: faults)."""
        config = EngineConfig(
            model=model, dtype=dtype, device=device, overlap=overlap, **engine_options
        )
        self.engine = AsyncEngine(config, device_wrapper=device_wrapper)
        self._runner = _LoopThread()
        # A process that never calls close() still exits cleanly.
        self._finalizer = weakref.finalize(self, _close, self.engine, self._runner)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **options: Any,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # one prompt, text or token ids
        items = [{"prompt": p} for p in prompts]
        return self._run_batch(items, params, options)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **options: Any,
    ) -> RequestOutput | list[RequestOutput]:
        """Apply the model's chat template; one conversation in, one output out."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        outs = self._run_batch([{"messages": c} for c in conversations], params, options)
        return outs[0] if single else outs

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate_items(
        self, items: list[dict[str, Any]], params: Sequence[SamplingParams | None]
    ) -> list[RequestOutput | ValueError]:
        """Mixed prompts ({"prompt": ...} or {"messages": ...}); a bad item yields its error."""
        return self._run_batch(items, list(params), {}, return_errors=True)

    def _run_batch(
        self,
        items: list[dict[str, Any]],
        params: Any,
        options: dict[str, Any],
        return_errors: bool = False,
    ) -> list[Any]:
        if not self._finalizer.alive:
            raise RuntimeError("LLM is closed")
        if params is None or isinstance(params, SamplingParams):
            params_list = [params] * len(items)
        else:
            params_list = list(params)
            if len(params_list) != len(items):
                raise ValueError(
                    f"params: got {len(params_list)} SamplingParams for {len(items)} prompts"
                )
        return self._runner.run(self._collect(items, params_list, options, return_errors))

    async def _collect(
        self,
        items: list[dict[str, Any]],
        params_list: list[Any],
        options: dict[str, Any],
        return_errors: bool,
    ) -> list[Any]:
        groups: list[RequestGroup | ValueError] = []
        try:
            for i, (item, params) in enumerate(zip(items, params_list, strict=True)):
                if i % SUBMIT_BETWEEN_STEPS == SUBMIT_BETWEEN_STEPS - 1:
                    await asyncio.sleep(0)  # the loop starts the first steps meanwhile
                try:
                    groups.append(self._submit(item, params, options))
                except ValueError as exc:
                    if not return_errors:
                        raise  # a bad prompt fails the call: the finally aborts the others
                    groups.append(exc)
            # In order, one after another: a task per request would cost more than waiting
            # (the requests run meanwhile, and most have ended when their turn comes).
            return [await self._gather(group) for group in groups]
        finally:
            for group in groups:
                if isinstance(group, RequestGroup):
                    group.release()

    def _submit(
        self, item: dict[str, Any], params: SamplingParams | None, options: dict[str, Any]
    ) -> RequestGroup:
        """The n samples of one item ({"prompt": ...} or {"messages": ...}) on the engine."""
        options = {**options, **{k: v for k, v in item.items() if k != "prompt"}}
        request_id = options.pop("request_id", None)
        # Whole results only: wake once per request, and detokenize once at the end unless
        # stop strings must be matched as the text grows.
        defaults = {"stream": False, "detokenize": bool(params and params.stop)}
        settings = RequestOptions(**{**defaults, **options})
        return submit(self.engine, item.get("prompt"), params, request_id, settings)

    async def _gather(self, group: RequestGroup | ValueError) -> RequestOutput | ValueError:
        if isinstance(group, ValueError):
            return group
        wholes = [RequestDelta(req.request_id, 0, [], "") for req in group.children]
        async for index, delta in group.deltas():
            wholes[index].merge(delta)
        group.release()
        samples = [
            self._output(req, whole) for req, whole in zip(group.children, wholes, strict=True)
        ]
        first = samples[0]
        first.request_id = group.request_id
        first.outputs = [
            CompletionOutput(
                i, s.token_ids, s.text, s.finish_reason, s.stop_reason, s.logprobs, s.top_logprobs
            )
            for i, s in enumerate(samples)
        ]
        return first

    def _output(self, req: Request, whole: RequestDelta) -> RequestOutput:
        """One sample's result, from all its output merged."""
        out = RequestOutput(req.request_id, req.prompt_ids, whole.token_ids, whole.text, "abort")
        out.logprobs, out.top_logprobs = whole.logprobs, whole.top_logprobs
        if whole.prompt_logprobs is not None:
            out.prompt_logprobs = prompt_logprob_dicts(req.prompt_ids, whole.prompt_logprobs)
        if whole.finished and whole.finish_reason is not None:
            out.finish_reason = whole.finish_reason.simple
            out.stop_reason = whole.stop_reason
            out.metrics = whole.timings
        tokenizer = self.engine.tokenizer
        if not req.params.stop and tokenizer is not None:  # else decoded as it grew
            out.text = decode_continuation(
                tokenizer, req.prompt_ids, out.token_ids, req.params.skip_special_tokens
            )
        out.num_cached_tokens = req.num_cached_tokens
        return out
