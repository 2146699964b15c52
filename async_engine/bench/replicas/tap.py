"""A byte relay in front of one replica that reads each request's head on the way in.

Whatever sits in front (a router, or the bench itself) talks to the tap instead of the
replica, so the bench learns which replica each request reached (the ``x-bench-group``
and ``x-request-id`` headers, which routers forward) without trusting the router's own
account, and when a caller dropped a request's connection (how a router passes a
cancellation on). Responses are relayed as they come, byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from async_engine.bench.replicas.client import GROUP_HEADER

HEAD_LIMIT = 1 << 20


class Tap:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.groups: Counter[str] = Counter()  # group tag -> requests seen
        self.dropped: dict[str, float] = {}  # request id -> when its caller hung up
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()  # both ends of every relayed connection
        self._relays: set[asyncio.Task] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0, limit=HEAD_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and end the relays still open (a router keeps idle connections),
        so that none is left to be cancelled mid-way when the loop ends."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._open):
            writer.close()
        if self._relays:
            await asyncio.wait(list(self._relays), timeout=2)

    def reset(self) -> None:
        self.groups.clear()
        self.dropped.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._open |= {writer, up_writer}
        relay = asyncio.current_task()
        if relay is not None:
            self._relays.add(relay)
            relay.add_done_callback(self._relays.discard)
        last_id: list[str] = []  # the request in flight on this connection
        inbound = asyncio.ensure_future(self._requests(reader, up_writer, last_id))
        outbound = asyncio.ensure_future(_pipe(up_reader, writer))
        done, _ = await asyncio.wait((inbound, outbound), return_when=asyncio.FIRST_COMPLETED)
        if inbound in done and not outbound.done() and last_id:
            # The caller hung up before the response ended: a cancellation reaching us.
            self.dropped.setdefault(last_id[-1], time.perf_counter())
        for task in (inbound, outbound):
            task.cancel()
        for w in (writer, up_writer):
            w.close()
            self._open.discard(w)

    async def _requests(
        self, reader: asyncio.StreamReader, up: asyncio.StreamWriter, last_id: list[str]
    ) -> None:
        """Relay requests one by one (a router reuses connections), noting each head."""
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                return
            headers = _headers(head)
            if tag := headers.get(GROUP_HEADER):
                self.groups[tag] += 1
            if rid := headers.get("x-request-id"):
                last_id.append(rid)
            up.write(head)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                await _pipe(reader, up)  # no length to find the next head by: relay the rest
                return
            length = int(headers.get("content-length", "0") or 0)
            while length > 0:
                piece = await reader.read(min(length, 65536))
                if not piece:
                    return
                up.write(piece)
                length -= len(piece)
            await up.drain()


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while piece := await reader.read(65536):
            writer.write(piece)
            await writer.drain()
