"""Device supervision: a device that dies, stops or hangs is replaced and the engine serves on.

The simulated device keeps these fast and checkable: its tokens are a pure function of the
request (``oracle_tokens``), so a request computed afresh on the new device must still
equal the oracle token for token.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from faults import withhold_after

from async_engine import AsyncEngine, SamplingParams
from async_engine.core.engine import EngineClosedError
from async_engine.core.request import FinishReason
from async_engine.core.supervisor import DeviceState, RestartPolicy, Supervisor
from streams.sim import oracle_tokens

SIM = {"device": "sim", "sim_step_ms": 2, "sim_token_us": 0, "sim_seq_us": 0, "sim_ctx_ns": 0}
PARAMS = SamplingParams(max_tokens=60, ignore_eos=True)


def prompt(i: int) -> list[int]:
    return [100 + i, 200 + i, 300 + i, 400 + i]


def oracle(engine: AsyncEngine, tokens: list[int], count: int) -> list[int]:
    mc = engine.model_config
    return oracle_tokens(tokens, count, 0, mc.vocab_size, tuple(mc.eos_token_ids))


async def drain(engine: AsyncEngine, req) -> tuple[list[int], FinishReason | None]:
    tokens, reason = [], None
    try:
        async for delta in engine.stream(req):
            tokens += delta.token_ids
            reason = delta.finish_reason
    finally:
        engine.release(req)
    return tokens, reason


async def until(condition, timeout: float = 20.0) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def assert_nothing_leaked(engine: AsyncEngine) -> None:
    assert engine.pool.num_used == 0
    assert not engine.scheduler.requests
    engine.pool.check_invariants()


@pytest.fixture
async def engine(default_model: Path):
    engine = AsyncEngine(model=str(default_model), device_heartbeat_timeout_s=1.0, **SIM)
    yield engine
    await engine.aclose()


async def test_a_killed_device_is_replaced_and_unread_requests_complete_as_if_nothing_happened(
    engine: AsyncEngine,
):
    watched = engine.add_request(prompt(0), PARAMS, "watched")
    unread = [engine.add_request(prompt(i), PARAMS, f"unread-{i}") for i in range(1, 8)]
    first = await anext(engine.stream(watched))  # the reader has seen output
    assert first.token_ids
    os.kill(engine.device.pid, signal.SIGKILL)
    rest, reason = await drain(engine, watched)
    assert reason is FinishReason.DEVICE_LOST
    assert first.token_ids + rest == oracle(engine, prompt(0), len(first.token_ids + rest))
    for i, req in enumerate(unread, start=1):
        tokens, reason = await drain(engine, req)
        assert reason is FinishReason.LENGTH
        assert tokens == oracle(engine, prompt(i), 60)
    assert engine.stats().device_restarts == 1
    assert engine.device_state is DeviceState.SERVING
    assert_nothing_leaked(engine)


async def test_a_request_after_the_restart_is_served(engine: AsyncEngine):
    req = engine.add_request(prompt(0), PARAMS)
    await anext(engine.stream(req))
    os.kill(engine.device.pid, signal.SIGKILL)
    await drain(engine, req)
    tokens, reason = await drain(engine, engine.add_request(prompt(9), PARAMS))
    assert (tokens, reason) == (oracle(engine, prompt(9), 60), FinishReason.LENGTH)


async def test_a_device_that_dies_while_idle_is_replaced_before_the_next_request(
    engine: AsyncEngine,
):
    await drain(engine, engine.add_request(prompt(0), PARAMS))
    os.kill(engine.device.pid, signal.SIGKILL)
    await until(lambda: engine.supervisor.restarts == 1, timeout=10)
    tokens, reason = await drain(engine, engine.add_request(prompt(1), PARAMS))
    assert (tokens, reason) == (oracle(engine, prompt(1), 60), FinishReason.LENGTH)


async def test_a_stopped_device_is_seen_by_its_quiet_heartbeat_and_replaced(engine: AsyncEngine):
    reqs = [engine.add_request(prompt(i), PARAMS) for i in range(4)]
    await until(lambda: engine.stats().steps > 3)
    old_pid = engine.device.pid
    os.kill(old_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    await until(lambda: engine.device_state is DeviceState.RESTARTING, timeout=5)
    assert time.monotonic() - stopped_at < 1.0 + 2 * engine.link.WATCHDOG_S + 0.5
    for i, req in enumerate(reqs):
        assert await drain(engine, req) == (oracle(engine, prompt(i), 60), FinishReason.LENGTH)
    assert engine.device.pid != old_pid
    with pytest.raises(ProcessLookupError):  # the stopped process was killed, not left behind
        for _ in range(100):
            os.kill(old_pid, 0)
            time.sleep(0.05)


async def test_an_idle_device_that_is_stopped_is_replaced_within_seconds(engine: AsyncEngine):
    await drain(engine, engine.add_request(prompt(0), PARAMS))
    os.kill(engine.device.pid, signal.SIGSTOP)
    took = await until(lambda: engine.supervisor.restarts == 1, timeout=10)
    assert took < 5.0
    tokens, reason = await drain(engine, engine.add_request(prompt(1), PARAMS))
    assert (tokens, reason) == (oracle(engine, prompt(1), 60), FinishReason.LENGTH)


async def test_a_step_past_its_deadline_loses_the_device_and_its_request_ends_on_the_second(
    default_model: Path,
):
    # Every device withholds results from the step holding token 7 on: a poison request.
    engine = AsyncEngine(
        model=str(default_model), device_step_timeout_s=0.5, device_wrapper=withhold_after(7), **SIM
    )
    try:
        poison = engine.add_request([5, 6, 7], PARAMS)
        tokens, reason = await drain(engine, poison)
        assert (tokens, reason) == ([], FinishReason.DEVICE_LOST)
        await until(lambda: engine.supervisor.restarts == 2)  # once afresh, then it ended
        tokens, reason = await drain(engine, engine.add_request(prompt(1), PARAMS))
        assert reason is FinishReason.LENGTH
        assert_nothing_leaked(engine)
    finally:
        await engine.aclose()


async def test_past_the_restart_budget_the_engine_stops_for_good(default_model: Path):
    engine = AsyncEngine(model=str(default_model), device_restart_limit=1, **SIM)
    try:
        await drain(engine, engine.add_request(prompt(0), PARAMS))
        os.kill(engine.device.pid, signal.SIGKILL)
        await until(lambda: engine.supervisor.restarts == 1)
        req = engine.add_request(prompt(1), PARAMS)
        await anext(engine.stream(req))
        os.kill(engine.device.pid, signal.SIGKILL)
        assert (await drain(engine, req))[1] is FinishReason.DEVICE_LOST
        await asyncio.wait_for(engine.stopped.wait(), 10)
        assert engine.device_state is DeviceState.FAILED
        with pytest.raises(EngineClosedError):
            engine.add_request(prompt(2), PARAMS)
    finally:
        await engine.aclose()


def test_offline_generate_survives_a_device_kill(default_model: Path):
    from async_engine import LLM

    with LLM(str(default_model), **SIM) as llm:
        batch = [prompt(i) for i in range(16)]
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        pid = llm.engine.device.pid

        def kill_soon() -> None:
            while llm.engine.stats().steps < 20:
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)

        import threading

        killer = threading.Thread(target=kill_soon)
        killer.start()
        outs = llm.generate(batch, params)
        killer.join()
        assert [o.token_ids for o in outs] == [oracle(llm.engine, p, 200) for p in batch]
        assert llm.stats().device_restarts == 1


def test_restart_attempts_back_off_and_are_budgeted_over_a_window():
    sup = Supervisor(RestartPolicy(max_restarts=3, window_s=100, backoff_s=1, max_backoff_s=3))
    assert sup.next_attempt_delay(now=0) == 0
    sup.attempt_failed()
    assert sup.next_attempt_delay(now=1) == 1
    sup.attempt_failed()
    assert sup.next_attempt_delay(now=3) == 2
    sup.attempt_failed()
    assert sup.next_attempt_delay(now=10) is None  # three attempts within 100 s
    assert sup.next_attempt_delay(now=200) == 3  # the window moved on; backoff capped
    sup.restarted()
    assert sup.next_attempt_delay(now=201) == 0
