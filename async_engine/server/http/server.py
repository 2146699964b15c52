"""uvicorn for the OpenAI app, run as a task of the loop the gRPC server runs on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from async_engine.server.start import ServerStartError


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGTERM and SIGINT belong to the serve command, which drains both APIs.
        yield


class _HeaderDeadline(H11Protocol):
    """Closes a connection whose request headers are not whole ``header_timeout_s`` after it
    opened or after its previous response: a client sending a header byte a second would
    otherwise hold its socket (and a slot of the accept backlog) forever."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_cycle = self.cycle
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._waiting_cycle and self._deadline is not None:
            self._deadline.cancel()  # the headers are in: a request cycle began
            self._deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._waiting_cycle = self.cycle
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class HttpServer:
    def __init__(self, app: object, host: str, port: int, header_timeout_s: float = 10.0) -> None:
        protocol = type(
            "HeaderDeadline", (_HeaderDeadline,), {"header_timeout_s": header_timeout_s}
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            loop="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            http=protocol,
        )
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        # The socket is bound here, not by uvicorn, which exits the process when it cannot.
        config = self._server.config
        try:
            sock = socket.create_server((config.host, config.port))
        except OSError as exc:
            raise ServerStartError(
                f"the HTTP API cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
            ) from None
        self._task = asyncio.create_task(self._server.serve([sock]), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped at start")
            await asyncio.sleep(0.01)

    @property
    def port(self) -> int:
        sockets = [s for server in self._server.servers for s in server.sockets]
        return sockets[0].getsockname()[1] if sockets else 0

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
