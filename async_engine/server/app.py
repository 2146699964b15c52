"""Server lifecycle: build the grpc.aio server around an engine, warm up, serve, drain.

``GenerationServer`` runs on the caller's event loop (the CLI's uvloop);
``BackgroundServer`` runs one on a private uvloop thread, for tests and benchmarks that
need a live server next to their own event loop. Their ``ServerOptions`` live in
server.options.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from async_engine.core.engine import AsyncEngine
from async_engine.core.supervisor import DeviceState
from async_engine.server.auth import BearerTokenInterceptor, Principals
from async_engine.server.handlers import add_generation_service
from async_engine.server.logs import ensure_logging
from async_engine.server.metrics import ServerMetrics
from async_engine.server.options import ServerOptions
from async_engine.server.service import GenerationService
from async_engine.server.stalls import StalledStreams
from async_engine.server.start import ServerStartError
from async_engine.server.state import ServingState
from async_engine.v1 import generation_pb2 as pb
from sampler.params import SamplingParams

log = structlog.get_logger("async_engine.server.service")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServer:
    DRAIN_STALL_S = 1.0  # while draining, a write stalled this long is a reader that left

    def __init__(self, engine: AsyncEngine, options: ServerOptions | None = None) -> None:
        ensure_logging()
        self.engine = engine
        self.options = opts = options or ServerOptions()
        metrics = ServerMetrics(
            str(engine.config.model), engine.config.block_size, engine.pool.num_blocks
        )
        principals = _principals(opts)
        for tenant in principals.tenants() if principals is not None else ():
            metrics.tenants.admit(tenant)  # a token file's tenants are known
        stalls = StalledStreams(opts.stream_idle_timeout_s)
        self.state = ServingState(engine, metrics, stalls, opts.limits, principals)
        self.service = GenerationService(self.state)
        self.health = health_aio.HealthServicer()
        self.port = 0
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.http_app: Any = None  # the OpenAI HTTP app (server/http/app.py), once started
        self._parts = contextlib.AsyncExitStack()  # what start started, each with its stop
        self._grace_s: float | None = 0.0  # for the gRPC server's stop (see stop)
        self._health_updates: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        """Start every part. A part that fails to start stops the ones started before it,
        in reverse order: no half-up server. ``stop`` stops them the same way."""
        opts = self.options
        # Stops run in reverse: gRPC's grace first, then HTTP (whose stop waits for its
        # streams) while the stall watch still cancels the ones nobody reads.
        async with contextlib.AsyncExitStack() as parts:
            if opts.metrics_port is not None:
                parts.callback(_close_endpoint, self._serve_metrics())
            refresher = asyncio.create_task(self._refresh_metrics(), name="metrics-refresh")
            parts.push_async_callback(_cancel, refresher)
            stall_watch = asyncio.create_task(self.state.stalls.watch(), name="stalled-streams")
            parts.push_async_callback(_cancel, stall_watch)
            if opts.http_port is not None:
                parts.push_async_callback(await self._serve_http())
            server = self._grpc_server()
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.port = _listen(server, opts)
            await server.start()
            parts.push_async_callback(lambda: server.stop(self._grace_s))
            if opts.warmup:
                self.state.warming = True  # HTTP /health says "not serving" meanwhile
                await self._warm_up()
                self.state.warming = False
                self.state.metrics.refresh(self.engine)  # not the warm-up's gauges
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            listeners = self.engine.supervisor.listeners
            listeners.append(self._on_device_state)
            parts.callback(listeners.remove, self._on_device_state)
            self._parts = parts.pop_all()
        log.info(
            "server.ready",
            port=self.port,
            metrics_port=self.metrics_port,
            http_port=self.http_port,
            model=str(self.engine.config.model),
            tls=opts.tls_cert is not None,
            auth=self.state.principals is not None,
        )

    def _serve_metrics(self) -> Any:
        """The /metrics endpoint, on a thread of prometheus_client's."""
        host, port = self.options.host, self.options.metrics_port
        try:
            httpd, _ = start_http_server(port, host, registry=self.state.metrics.registry)
        except OSError as exc:
            raise ServerStartError(
                f"the metrics endpoint cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self.metrics_port = httpd.server_port
        return httpd

    async def _serve_http(self) -> Callable[[], Awaitable[None]]:
        """The OpenAI HTTP API, started; returns its stop."""
        # Imported here: a server without the HTTP API never loads starlette and uvicorn.
        from async_engine.server.http.app import OpenAIApp
        from async_engine.server.http.server import HttpServer

        opts = self.options
        self.http_app = OpenAIApp(self.state, opts.max_message_bytes, opts.http_body_timeout_s)
        app = self.http_app.app
        host = opts.http_host or opts.host
        http = HttpServer(app, host, opts.http_port or 0, opts.http_header_timeout_s)
        await http.start()
        self.http_port = http.port
        return http.stop

    def _grpc_server(self) -> grpc.aio.Server:
        opts = self.options
        principals = self.state.principals
        server = grpc.aio.server(
            interceptors=[BearerTokenInterceptor(principals)] if principals else [],
            options=[
                ("grpc.max_receive_message_length", opts.max_message_bytes),
                ("grpc.max_send_message_length", opts.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a busy port must fail, not be shared
            ],
        )
        add_generation_service(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        names = (SERVICE_NAME, health_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        return server

    async def _warm_up(self) -> None:
        """One tiny request, so that the first client does not pay for lazy initialisation."""
        token = min(100, self.engine.model_config.vocab_size - 1)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in self.engine.generate([token] * 4, params, detokenize=False):
            pass

    async def _refresh_metrics(self) -> None:
        while True:
            try:
                self.state.metrics.refresh(self.engine)
            except Exception:  # a metrics bug must never take the server down
                log.exception("metrics.refresh_failed")
            await asyncio.sleep(self.options.metrics_interval_s)

    def _on_device_state(self, state: DeviceState) -> None:
        """Health follows the device at once: NOT_SERVING while it restarts (or for good),
        SERVING again when a new one serves (unless the server is draining)."""
        task = asyncio.get_running_loop().create_task(self._set_health(state))
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _set_health(self, state: DeviceState) -> None:
        serving = state is DeviceState.SERVING
        if serving and self.state.draining:
            return
        status = health_pb2.HealthCheckResponse
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status.SERVING if serving else status.NOT_SERVING)
        log.info("server.health", serving=serving, device=state.value)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests, report NOT_SERVING, wait for in-flight ones. True if all ended."""
        timeout = self.options.drain_timeout_s if timeout_s is None else timeout_s
        calls = self.service.calls
        self.state.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("server.draining", in_flight=len(calls), timeout_s=timeout)
        deadline = time.monotonic() + timeout
        while calls:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("server.drain_timeout", still_running=len(calls))
                return False
            # A stream nobody reads would hold the drain to its end: once its write has
            # stalled for a moment, it is cancelled instead of waited for.
            self.state.stalls.cancel_stalled(self.DRAIN_STALL_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.service.idle.wait(), min(0.1, remaining))
        return True

    async def stop(self, grace_s: float | None = 0.5) -> None:
        """Stop serving; RPCs still open after grace are cancelled (and their requests aborted)."""
        self._grace_s = grace_s
        await self._parts.aclose()
        self._stopped.set()
        log.info("server.stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def _principals(opts: ServerOptions) -> Principals | None:
    """Who may call: None without auth."""
    if opts.auth_token_file is not None:
        return Principals.load(opts.auth_token_file)
    if opts.auth_token:
        return Principals.single(opts.auth_token)
    return None


def _listen(server: grpc.aio.Server, opts: ServerOptions) -> int:
    """Bind the gRPC port (TLS where a certificate is given); the port bound."""
    address = f"{opts.host}:{opts.port}"
    try:
        if opts.tls_cert is not None and opts.tls_key is not None:
            with open(opts.tls_key, "rb") as k, open(opts.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            return server.add_secure_port(address, creds)
        return server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's "failed to bind"
        raise ServerStartError(f"gRPC cannot listen on {address}: {exc}") from None


def _close_endpoint(httpd: Any) -> None:
    httpd.shutdown()
    httpd.server_close()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class BackgroundServer:
    """A GenerationServer on its own uvloop thread. The engine is created by the caller
    (outside any loop) and from now on belongs to this server's loop."""

    def __init__(self, engine: AsyncEngine, options: ServerOptions | None = None) -> None:
        import uvloop

        self.engine = engine
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="grpc-server"
        )
        self._thread.start()
        self.server: GenerationServer = self.call(_make_server(engine, options))
        self.call(self.server.start())

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return f"{self.server.options.host}:{self.server.port}"

    def call(self, coro: Any, timeout: float | None = 120) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, close_engine: bool = True) -> None:
        if not self.loop.is_running():
            return
        self.call(self.server.stop(0))
        if close_engine:
            self.call(self.engine.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


async def _make_server(engine: AsyncEngine, options: ServerOptions | None) -> GenerationServer:
    return GenerationServer(engine, options)  # built on the loop: its asyncio objects bind there
