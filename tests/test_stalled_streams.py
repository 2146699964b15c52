"""Stalled writes: a streaming handler whose client stopped reading is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from async_engine.server.stalls import StalledStreams


async def blocked_writer(stalls: StalledStreams, released: list[str]) -> None:
    try:
        with stalls.write():
            await asyncio.Event().wait()  # a write the client never takes
    finally:
        released.append("cleanup ran")  # where a handler aborts its requests


async def test_a_write_stalled_past_the_timeout_is_cancelled_and_cleans_up():
    stalls, released = StalledStreams(timeout_s=0.2), []
    watch = asyncio.create_task(stalls.watch())
    task = asyncio.create_task(blocked_writer(stalls, released))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)
    watch.cancel()
    assert released == ["cleanup ran"]
    assert stalls.cancelled == 1 and stalls.num_writing == 0


async def test_writes_that_complete_are_never_cancelled():
    stalls = StalledStreams(timeout_s=0.05)

    async def steady_writer() -> int:
        written = 0
        for _ in range(20):
            with stalls.write():
                await asyncio.sleep(0.01)  # each write is taken quickly
            written += 1
        return written

    watch = asyncio.create_task(stalls.watch())
    assert await steady_writer() == 20
    watch.cancel()
    assert stalls.cancelled == 0


async def test_cancel_stalled_uses_the_threshold_it_is_given():
    stalls, released = StalledStreams(timeout_s=3600), []
    task = asyncio.create_task(blocked_writer(stalls, released))
    await asyncio.sleep(0.05)
    assert stalls.cancel_stalled(older_than_s=10) == 0  # e.g. a drain's short threshold
    assert stalls.cancel_stalled(older_than_s=0.01) == 1
    await asyncio.gather(task, return_exceptions=True)
    assert released == ["cleanup ran"]


def test_a_timeout_of_zero_is_refused():
    with pytest.raises(ValueError, match="stream idle timeout"):
        StalledStreams(0)


def test_a_drain_cancels_a_stream_whose_write_stalls_instead_of_waiting(default_model):
    from server_helpers import start_server

    from async_engine.core.group import RequestGroup
    from async_engine.server.app import ServerOptions
    from async_engine.server.service import _Call

    server = start_server(
        default_model, ServerOptions(port=0, metrics_port=None), device="sim", dtype="bfloat16"
    )
    service, released = server.server.service, []

    async def handler_stuck_writing() -> None:
        """What a Generate handler looks like to a client that never reads: in a write."""
        service.calls["stuck"] = _Call("stuck", "stuck", RequestGroup(server.engine, "stuck", []))
        service.idle.clear()
        try:
            await blocked_writer(service.state.stalls, released)
        finally:
            service.calls.pop("stuck")
            service.idle.set()

    async def start_then_drain() -> tuple[bool, float]:
        asyncio.get_running_loop().create_task(handler_stuck_writing())
        await asyncio.sleep(0.05)
        start = asyncio.get_running_loop().time()
        drained = await server.server.drain(timeout_s=30)
        return drained, asyncio.get_running_loop().time() - start

    try:
        drained, took = server.call(start_then_drain())
        assert drained and took < 3.0  # not the 30 s drain timeout
        assert released == ["cleanup ran"]
    finally:
        server.close()
