"""uvicorn for the OpenAI app, run as a task of the loop the gRPC server runs on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from async_engine.server.start import ServerStartError


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGTERM and SIGINT belong to the serve command, which drains both APIs.
        yield


class HttpServer:
    def __init__(self, app: object, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off",
                                log_level="warning", access_log=False)  # fmt: skip
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        # The socket is bound here, not by uvicorn, which exits the process when it cannot.
        config = self._server.config
        try:
            sock = socket.create_server((config.host, config.port))
        except OSError as exc:
            raise ServerStartError(f"the HTTP API cannot listen on {config.host}:{config.port}: "
                               f"{exc.strerror or exc}") from None  # fmt: skip
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
