"""Prometheus metrics of a server: vLLM-compatible names and buckets, plus our own.

Each server owns a CollectorRegistry (no process-global state), so several servers can
live in one process (tests, benchmarks). Gauges are refreshed from the engine by the
server's event loop; nothing here reads the engine from the HTTP thread. Per-request
series are fed by ``on_release``, which every front end's request group calls once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from async_engine.core.request import FinishReason, Request
from async_engine.server.histograms import BulkHistogram
from async_engine.server.spec_metrics import SpeculationMetrics
from async_engine.server.tenant_labels import TenantLabels

if TYPE_CHECKING:
    from async_engine.core.engine import AsyncEngine

# The buckets vLLM uses, so that dashboards built for it read our series unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Cancellation reaches the KV cache within a step or two: milliseconds, not seconds.
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

log = structlog.get_logger("async_engine.server.metrics")
MAX_TENANTS = 64  # label cardinality guard: the rest share the label "other"
# vLLM's finished_reason values: stop, length, abort (and error), as FinishReason.simple says.
FINISHED_REASONS = tuple(dict.fromkeys(reason.simple for reason in FinishReason))


class ServerMetrics:
    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int | None = None) -> None:
        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        self.block_size = block_size
        m = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=reg)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, [*m, *labels], registry=reg)

        def histogram(name: str, doc: str, buckets: tuple, *labels: str) -> Histogram:
            return Histogram(name, doc, [*m, *labels], buckets=buckets, registry=reg)

        # The KV cache's layout, for gateways that route by it (value always 1); the block
        # count is known once the device has sized the cache (see ``describe_cache``).
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "KV cache configuration",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=reg,
        )
        self._num_gpu_blocks: int | None = None
        if num_gpu_blocks is not None:
            self.describe_cache(num_gpu_blocks)
        self.running = gauge("vllm:num_requests_running", "Requests running on the device")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be admitted")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS
        )
        self.itl = BulkHistogram(  # one value per generated token: observed in bulk
            "vllm:inter_token_latency_seconds", "Inter-token latency", m, ITL_BUCKETS, reg
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency", REQUEST_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Time waiting for admission", REQUEST_BUCKETS
        )
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        # In tokens, as vLLM's: the tokens of full prompt blocks looked up, and of those found.
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queried tokens")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hit tokens")
        self.success = counter("vllm:request_success", "Finished requests", "finished_reason")
        self.idle = gauge(
            "async_engine:device_idle_fraction",
            "Share of recent device time spent waiting on the control plane",
        )
        self.device_seconds = counter(
            "async_engine:device_seconds",
            "Device time by state: busy, or idle while requests had work",
            "state",
        )
        self.phase_seconds = counter(
            "async_engine:step_phase_seconds",
            "Control-plane time per step phase (wait = on the device)",
            "phase",
        )
        self.steps = counter("async_engine:steps", "Device steps completed")
        self.engine_requests = gauge(
            "async_engine:engine_requests",
            "Requests the engine holds: queued, running, or ending (0 when idle, or a leak)",
        )
        self.engine_streams = gauge(
            "async_engine:engine_streams",
            "Output streams the engine keeps for readers (0 when idle, or a leak)",
        )
        self.device_up = gauge(
            "async_engine:device_up",
            "1 while the device serves; 0 while it restarts after a loss or has failed",
        )
        self.device_restarts = counter(
            "async_engine:device_restarts", "Devices replaced after a loss"
        )
        self.cancel_lag = histogram(
            "async_engine:cancellation_lag_seconds",
            "From abort to the request's KV blocks back in the pool",
            LAG_BUCKETS,
        )
        self.wasted = counter(
            "async_engine:wasted_tokens", "Tokens computed for requests that had already ended"
        )
        self.fragmentation = gauge(
            "async_engine:kv_fragmentation", "Share of allocated KV slots holding no token"
        )
        self.speculation = SpeculationMetrics(reg, model_name)
        self.tenant_e2e = histogram(
            "async_engine:tenant_e2e_request_latency_seconds",
            "End-to-end request latency by tenant",
            REQUEST_BUCKETS,
            "tenant",
        )
        self.tenant_ttft = histogram(
            "async_engine:tenant_time_to_first_token_seconds",
            "Time to first token by tenant",
            TTFT_BUCKETS,
            "tenant",
        )
        self.tenant_itl = BulkHistogram(
            "async_engine:tenant_inter_token_latency_seconds",
            "Inter-token latency by tenant",
            [*m, "tenant"],
            ITL_BUCKETS,
            reg,
        )
        self.tenant_service = counter(
            "async_engine:tenant_service_tokens",
            "Tokens served by tenant: prompt tokens computed, output tokens generated",
            "tenant",
            "kind",
        )
        # Create every model-labelled series now, so that counters read 0 before their first event.
        for metric in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.ttft,
            self.e2e,
            self.queue,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.idle,
            self.cancel_lag,
            self.wasted,
            self.fragmentation,
        ):
            metric.labels(model_name)
        for reason in FINISHED_REASONS:  # as vLLM: every reason's series exists from the start
            self.success.labels(model_name, reason)
        self.itl.observe_many((model_name,), ())
        self.tenants = TenantLabels(MAX_TENANTS)
        self._last_counts: dict[str, int] = {}
        self._last_phase: dict[str, float] = {}
        self._awaiting_release: list[Request] = []

    def describe_cache(self, num_gpu_blocks: int) -> None:
        """Label ``vllm:cache_config_info`` with the KV cache's block count (once it is known,
        and again should it change)."""
        if num_gpu_blocks == self._num_gpu_blocks:
            return
        self._num_gpu_blocks = num_gpu_blocks
        self.cache_config.clear()
        self.cache_config.labels(self.model_name, str(self.block_size), str(num_gpu_blocks)).set(1)

    # ------------------------------------------------------------ per request
    def on_release(self, children: list[Request]) -> None:
        """A request group's children, once its front end let go of them (``core.group``)."""
        for req in children:
            try:
                self.on_request_end(req)
            except Exception:  # a metrics bug must not fail the request's stream or answer
                log.exception("metrics.request_end_failed", request_id=req.request_id)

    def on_request_end(self, req: Request) -> None:
        """Record a request the server is done with (finished, aborted or failed)."""
        name = self.model_name
        if req.finish_reason is not None:
            self.success.labels(name, req.finish_reason.simple).inc()
        self.prompt_tokens.labels(name).inc(req.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(len(req.output_ids))
        if req.scheduled_time is not None:
            self.queue.labels(name).observe(req.scheduled_time - req.arrival_time)
        if req.first_token_time is not None:
            self.ttft.labels(name).observe(req.first_token_time - req.arrival_time)
        times = req.token_times
        gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        self.itl.observe_many((name,), gaps)
        tenant = self.tenants.label(req.tenant)
        if req.first_token_time is not None:
            self.tenant_ttft.labels(name, tenant).observe(req.first_token_time - req.arrival_time)
        self.tenant_itl.observe_many((name, tenant), gaps)
        self.tenant_service.labels(name, tenant, "prompt").inc(
            max(0, req.num_prompt_tokens - req.num_cached_tokens)
        )
        self.tenant_service.labels(name, tenant, "output").inc(len(req.output_ids))
        if req.finished_time is not None:
            e2e = req.finished_time - req.arrival_time
            self.e2e.labels(name).observe(e2e)
            self.tenant_e2e.labels(name, tenant).observe(e2e)
        if req.abort_time is not None:
            self._awaiting_release.append(req)
            self._observe_released()

    def _observe_released(self) -> None:
        # Blocks are freed after the step that last wrote them completes, so the lag of an
        # abort is only known a step or two after the server let go of the request.
        pending = []
        for req in self._awaiting_release:
            if req.released_time is None:
                pending.append(req)
            elif req.abort_time is not None:
                self.cancel_lag.labels(self.model_name).observe(
                    max(0.0, req.released_time - req.abort_time)
                )
        self._awaiting_release = pending

    # ------------------------------------------------------------- periodic
    def refresh(self, engine: AsyncEngine) -> None:
        """Copy the engine's state into the gauges; call from the engine's event loop."""
        name = self.model_name
        stats = engine.stats()
        self.describe_cache(stats.kv_blocks_total)
        self.running.labels(name).set(stats.running)
        self.waiting.labels(name).set(stats.waiting)
        self.kv_usage.labels(name).set(stats.kv_usage)
        self.idle.labels(name).set(stats.device_idle_fraction)
        self.fragmentation.labels(name).set(kv_fragmentation(engine, self.block_size))
        self.device_up.labels(name).set(stats.device_state == "serving")
        self.engine_requests.labels(name).set(len(engine.scheduler.requests))
        self.engine_streams.labels(name).set(engine.num_streams)
        self.speculation.refresh(stats)
        for key, counter, value in (
            ("preemptions", self.preemptions, stats.num_preemptions),
            ("wasted", self.wasted, stats.wasted_tokens),
            ("prefix_queries", self.prefix_queries, stats.prefix_cache_queries),
            ("prefix_hits", self.prefix_hits, stats.prefix_cache_hits),
            ("steps", self.steps, stats.steps),
            ("restarts", self.device_restarts, stats.device_restarts),
        ):
            grown = value - self._last_counts.get(key, 0)
            if grown > 0:
                counter.labels(name).inc(grown)
            self._last_counts[key] = value
        for state, seconds in (
            ("busy", stats.device_busy_seconds),
            ("idle", stats.device_idle_seconds),
        ):
            grown = seconds - self._last_phase.get(f"device:{state}", 0.0)
            if grown > 0:
                self.device_seconds.labels(name, state).inc(grown)
            self._last_phase[f"device:{state}"] = seconds
        for phase, seconds in stats.phase_seconds.items():
            grown = seconds - self._last_phase.get(phase, 0.0)
            if grown > 0:
                self.phase_seconds.labels(name, phase).inc(grown)
            self._last_phase[phase] = seconds
        self._observe_released()


def kv_fragmentation(engine: AsyncEngine, block_size: int) -> float:
    """Allocated-but-empty KV slots over allocated slots, across running requests."""
    allocated = used = 0
    for req in engine.scheduler.running:
        slots = len(req.block_ids) * block_size
        allocated += slots
        used += min(slots, req.num_computed_tokens)
    return (allocated - used) / allocated if allocated else 0.0
