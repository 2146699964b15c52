"""The device process's own side, run as ``python -m streams.device_loop``: it builds the
runner, then reads plans off one pipe between steps and writes results to the other, and
stamps a heartbeat page from a thread of its own (see ``streams.process_device``).
"""

from __future__ import annotations

import mmap
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from streams.device import DeviceError, DeviceSpec, Runner
from streams.heap import keep_large_blocks_in_heap
from streams.plan import StepResult
from streams.wire import (
    FAILED,
    READY,
    REPLAY,
    RESULT,
    SHUTDOWN,
    STEP,
    decode_plan,
    encode_result,
)

HEARTBEAT_S = 0.2  # how often the device process stamps its heartbeat


def _start_heartbeat(path: str) -> None:
    """Stamp the heartbeat page from a thread: a process that is stopped, or wedged with the
    GIL held, goes quiet, which a dead-process check alone cannot see."""
    with open(path, "r+b") as f:
        page = mmap.mmap(f.fileno(), 8)

    def beat() -> None:
        while True:
            struct.pack_into("d", page, 0, time.monotonic())
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()


def _device_main(plan_recv: Connection, result_send: Connection, heartbeat: str) -> None:
    # Ctrl-C, `timeout` and service managers signal the whole process group: the server
    # drains on them and then shuts the device down itself (or the device sees its pipes
    # close). Killed with it, the device would end every in-flight stream mid-drain.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _start_heartbeat(heartbeat)
    keep_large_blocks_in_heap()
    try:
        spec: DeviceSpec = pickle.loads(plan_recv.recv_bytes())
        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        runner = spec.runner_factory()
    except Exception:
        result_send.send_bytes(FAILED + traceback.format_exc().encode())
        return
    result_send.send_bytes(READY + pickle.dumps(runner.info))
    _run(runner, plan_recv, result_send)


def _run(runner: Runner, plan_recv: Connection, result_send: Connection) -> None:
    """This thread reads plans and launches them; a completer thread waits for each step
    (``finish``: a GPU's event wait releases the GIL, the simulated device waits for its
    modelled end) and sends results in launch order. So the next plan is read, decoded and
    launched while a step runs."""
    launched: queue.Queue[tuple[Any, StepResult | None] | None] = queue.Queue()

    def complete() -> None:
        while True:
            item = launched.get()
            if item is None:
                return
            pending, result = item
            try:
                if result is None:
                    result = runner.finish(pending)
            except DeviceError:
                traceback.print_exc()
                os._exit(70)  # the control plane sees the process gone and replaces it
            except Exception as exc:
                result = StepResult(pending.step_id, [], error=f"{type(exc).__name__}: {exc}")
            try:
                result_send.send_bytes(RESULT + encode_result(result))
            except (BrokenPipeError, OSError):
                os._exit(0)  # the control plane went away
            finally:
                launched.task_done()

    completer = threading.Thread(target=complete, daemon=True, name="completer")
    completer.start()
    while True:
        try:
            kind, payload, arrived_at = _read(plan_recv)
        except (EOFError, OSError):
            kind, payload, arrived_at = SHUTDOWN, None, 0.0
        if kind == SHUTDOWN:
            launched.put(None)
            completer.join(timeout=30)
            return
        try:
            if kind == STEP:
                launched.put((runner.launch(payload, arrived_at), None))
            elif kind == REPLAY:
                launched.join()  # a replay runs on an idle device
                launched.put((None, runner.replay(payload)))
        except DeviceError:
            traceback.print_exc()
            os._exit(70)


def _exit_without_teardown() -> None:
    """Skip the interpreter's teardown of torch (half a second of every engine's close): the
    pipes are written through and the runner keeps nothing to save. Not after CUDA ran:
    its teardown flushes what a profiler (nsys, CUPTI) collected."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _read(plan_recv: Connection) -> tuple[bytes, Any, float]:
    """One message: its kind, its decoded plan (a step) or plans (a replay), and when it
    came in (before decoding it)."""
    frame = plan_recv.recv_bytes()
    arrived_at = time.monotonic()
    kind = frame[:1]
    if kind == STEP:
        return kind, decode_plan(memoryview(frame)[1:]), arrived_at
    if kind == REPLAY:
        plans = [decode_plan(f) for f in pickle.loads(memoryview(frame)[1:])]
        return kind, plans, arrived_at
    return kind, None, arrived_at


if __name__ == "__main__":
    _device_main(
        Connection(int(sys.argv[1]), writable=False),
        Connection(int(sys.argv[2]), readable=False),
        sys.argv[3],
    )
    _exit_without_teardown()
