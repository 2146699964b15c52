"""LLM: the offline, synchronous API over AsyncEngine.

The engine's event loop runs on a private thread, so ``LLM`` works from plain scripts,
from notebooks that already run a loop, and from several instances one after another.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from async_engine.core.config import EngineConfig
from async_engine.core.engine import AsyncEngine
from async_engine.core.fanout import child_ids, child_params, parent_id
from async_engine.core.output import RequestDelta
from async_engine.core.request import Request
from async_engine.core.stats import EngineStats
from async_engine.core.tokenizer import decode_continuation
from sampler.params import SamplingParams
from streams.device import Device

Prompt = str | list[int]


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
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: list[CompletionOutput] = field(default_factory=list)


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
        engine = self.engine
        # Validate every prompt before queueing any, so a bad one fails the call cleanly.
        groups: list[list[Request] | ValueError] = []
        try:
            for item, params in zip(items, params_list, strict=True):
                try:
                    groups.append(self._add_samples(item, params, options))
                except ValueError as exc:
                    if not return_errors:
                        raise
                    groups.append(exc)
        except BaseException:
            for group in groups:
                for req in group if isinstance(group, list) else []:
                    engine.release(req)
            raise
        return list(await asyncio.gather(*(self._gather(g) for g in groups)))

    def _add_samples(
        self, item: dict[str, Any], params: SamplingParams | None, options: dict[str, Any]
    ) -> list[Request]:
        """One request per sample: n > 1 fans out into children (see core.fanout)."""
        n = 1 if params is None else params.n
        # Whole results only: wake once per request, and detokenize once at the end unless
        # stop strings must be matched as the text grows.
        options = {"stream": False, "detokenize": bool(params and params.stop), **options}
        if n == 1:
            return [self.engine.add_request(params=params, **item, **options)]
        base = options.get("request_id") or uuid.uuid4().hex
        rest = {k: v for k, v in options.items() if k != "request_id"}
        children: list[Request] = []
        try:
            for i, child_id in enumerate(child_ids(base, n)):
                children.append(
                    self.engine.add_request(
                        params=child_params(params, n, i), request_id=child_id, **item, **rest
                    )
                )
        except BaseException:
            for req in children:
                self.engine.release(req)
            raise
        return children

    async def _gather(self, group: list[Request] | ValueError) -> RequestOutput | ValueError:
        if isinstance(group, ValueError):
            return group
        samples = await asyncio.gather(*(self._drain(req) for req in group))
        first = samples[0]
        if len(group) > 1:
            first.request_id = parent_id(first.request_id)
        first.outputs = [
            CompletionOutput(
                i, s.token_ids, s.text, s.finish_reason, s.stop_reason, s.logprobs, s.top_logprobs
            )
            for i, s in enumerate(samples)
        ]
        return first

    async def _drain(self, req: Request) -> RequestOutput:
        engine = self.engine
        whole = RequestDelta(req.request_id, 0, [], "")
        try:
            async for delta in engine.stream(req):
                whole.merge(delta)
        finally:
            engine.release(req)
        out = RequestOutput(req.request_id, req.prompt_ids, whole.token_ids, whole.text, "abort")
        out.logprobs, out.top_logprobs = whole.logprobs, whole.top_logprobs
        if whole.finished and whole.finish_reason is not None:
            out.finish_reason = whole.finish_reason.simple
            out.stop_reason = whole.stop_reason
            out.metrics = whole.timings
        tokenizer = engine.tokenizer
        if not req.params.stop and tokenizer is not None:
            out.text = decode_continuation(
                tokenizer, req.prompt_ids, out.token_ids, req.params.skip_special_tokens
            )
        out.num_cached_tokens = req.num_cached_tokens
        return out
