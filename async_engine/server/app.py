"""Server lifecycle: build the grpc.aio server around an engine, warm up, serve, drain.

``GenerationServer`` runs on the caller's event loop (the CLI's uvloop);
``BackgroundServer`` runs one on a private uvloop thread, for tests and benchmarks that
need a live server next to their own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
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
from async_engine.server.codec import Limits
from async_engine.server.handlers import add_generation_service
from async_engine.server.logs import ensure_logging
from async_engine.server.metrics import ServerMetrics
from async_engine.server.service import GenerationService
from async_engine.server.stalls import StalledStreams
from async_engine.server.start import ServerStartError
from async_engine.v1 import generation_pb2 as pb
from sampler.params import SamplingParams

log = structlog.get_logger("async_engine.server.service")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless the operator opens it up
    port: int = 50051  # 0: any free port (see GenerationServer.port)
    metrics_port: int | None = 9400  # None: no /metrics endpoint; 0: any free port
    drain_timeout_s: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None  # one unrestricted principal
    auth_token_file: str | None = None  # tokens -> principals (see server.auth)
    max_message_bytes: int = 4 << 20  # gRPC rejects larger requests with RESOURCE_EXHAUSTED
    limits: Limits = field(default_factory=Limits)
    metrics_interval_s: float = 0.25
    stream_idle_timeout_s: float = 60.0  # a stream whose write stalls this long is cancelled
    warmup: bool = True
    http_port: int | None = None  # the OpenAI-compatible HTTP API; None: off, 0: any free port
    http_host: str | None = None  # default: ``host``
    http_header_timeout_s: float = 10.0  # a request's headers must be whole in this time
    http_body_timeout_s: float = 30.0  # and its body, once the headers are in

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ValueError(
                "auth_token and auth_token_file are exclusive: put the token in the file"
            )
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        for name in ("http_header_timeout_s", "http_body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class GenerationServer:
    DRAIN_STALL_S = 1.0  # while draining, a write stalled this long is a reader that left

    def __init__(self, engine: AsyncEngine, options: ServerOptions | None = None) -> None:
        ensure_logging()
        self.engine = engine
        self.options = opts = options or ServerOptions()
        self.metrics = ServerMetrics(str(engine.config.model), engine.config.block_size)
        self.stalls = StalledStreams(opts.stream_idle_timeout_s)
        self.principals: Principals | None = None
        if opts.auth_token_file is not None:
            self.principals = Principals.load(opts.auth_token_file)
        elif opts.auth_token:
            self.principals = Principals.single(opts.auth_token)
        if self.principals is not None:
            for tenant in self.principals.tenants():  # a token file's tenants are known
                self.metrics.tenants.admit(tenant)
        self.service = GenerationService(engine, self.metrics, opts.limits, self.stalls,
                                         self.principals)  # fmt: skip
        self.health = health_aio.HealthServicer()
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._httpd: Any = None
        self.http: Any = None  # the OpenAI HTTP server, when http_port is set
        self.http_port: int | None = None
        self._refresher: asyncio.Task | None = None
        self._stall_watch: asyncio.Task | None = None
        self._health_updates: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        opts = self.options
        interceptors = [BearerTokenInterceptor(self.principals)] if self.principals else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", opts.max_message_bytes),
                ("grpc.max_send_message_length", opts.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a busy port must fail, not be shared
            ],
        )
        add_generation_service(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{opts.host}:{opts.port}"
        try:
            if opts.tls_cert is not None and opts.tls_key is not None:
                with open(opts.tls_key, "rb") as k, open(opts.tls_cert, "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc's "failed to bind"
            raise ServerStartError(f"gRPC cannot listen on {address}: {exc}") from None
        self._server = server
        await server.start()
        try:
            if opts.metrics_port is not None:
                try:
                    self._httpd, _ = start_http_server(
                        opts.metrics_port, opts.host, registry=self.metrics.registry
                    )
                except OSError as exc:
                    raise ServerStartError(f"the metrics endpoint cannot listen on {opts.host}:"
                                       f"{opts.metrics_port}: {exc.strerror or exc}") from None  # fmt: skip
                self.metrics_port = self._httpd.server_port
            if opts.http_port is not None:
                from async_engine.server.http.app import OpenAIApp
                from async_engine.server.http.server import HttpServer

                app = OpenAIApp(self, opts.max_message_bytes, opts.http_body_timeout_s).app
                self.http = HttpServer(app, opts.http_host or opts.host, opts.http_port,
                                       opts.http_header_timeout_s)  # fmt: skip
                await self.http.start()
                self.http_port = self.http.port
        except BaseException:
            await self.stop(grace_s=0)  # what started is closed again: no half-up server
            raise
        self._refresher = asyncio.create_task(self._refresh_metrics(), name="metrics-refresh")
        self._stall_watch = asyncio.create_task(self.stalls.watch(), name="stalled-streams")
        if opts.warmup:
            await self._warm_up()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.engine.supervisor.listeners.append(self._on_device_state)
        log.info(
            "server.ready",
            port=self.port,
            metrics_port=self.metrics_port,
            http_port=self.http_port,
            model=str(self.engine.config.model),
            tls=opts.tls_cert is not None,
            auth=self.principals is not None,
        )

    async def _warm_up(self) -> None:
        """One tiny request, so that the first client does not pay for lazy initialisation."""
        token = min(100, self.engine.model_config.vocab_size - 1)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        async for _ in self.engine.generate([token] * 4, params, detokenize=False):
            pass

    async def _refresh_metrics(self) -> None:
        while True:
            try:
                self.metrics.refresh(self.engine)
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
        if serving and self.service.draining:
            return
        status = health_pb2.HealthCheckResponse
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status.SERVING if serving else status.NOT_SERVING)
        log.info("server.health", serving=serving, device=state.value)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests, report NOT_SERVING, wait for in-flight ones. True if all ended."""
        timeout = self.options.drain_timeout_s if timeout_s is None else timeout_s
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        log.info("server.draining", in_flight=len(self.service.calls), timeout_s=timeout)
        deadline = time.monotonic() + timeout
        while self.service.calls:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("server.drain_timeout", still_running=len(self.service.calls))
                return False
            # A stream nobody reads would hold the drain to its end: once its write has
            # stalled for a moment, it is cancelled instead of waited for.
            self.stalls.cancel_stalled(self.DRAIN_STALL_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.service.idle.wait(), min(0.1, remaining))
        return True

    async def stop(self, grace_s: float | None = 0.5) -> None:
        """Stop serving; RPCs still open after grace are cancelled (and their requests aborted)."""
        listeners = self.engine.supervisor.listeners
        if self._on_device_state in listeners:
            listeners.remove(self._on_device_state)
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.http is not None:
            await self.http.stop()
            self.http = None
        for task in (self._refresher, self._stall_watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        self._stopped.set()
        log.info("server.stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


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
