"""The device process: a separate interpreter that owns the runner (weights and KV cache).

A forward pass on a thread of the control plane's process stalls whenever the control
plane runs Python (every eager op needs the GIL), so every device runs in its own process:
the CPU model, the simulated device, and the CUDA model alike. Plans arrive as flat byte
frames over one pipe and results leave over another; the control plane's event loop
watches the result pipe. The plan pipe is enlarged so that ``launch`` never blocks on a
busy device, and the device reads it on its own main thread between steps: a receiver
thread would need the GIL and a free core to hand a plan over, and on a 2-core machine
with busy torch threads that handoff cost about a millisecond per step.

The process is a fresh interpreter (``python -m streams.process_device``), not a
multiprocessing child: the caller's ``__main__`` is never re-imported, so scripts need no
``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import mmap
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from streams.device import Device, DeviceError, DeviceSpec
from streams.plan import StepPlan, StepResult
from streams.sim import PreciseClock
from streams.wire import decode_plan, decode_result, encode_plan, encode_result

# glibc hands each multi-megabyte temporary (gathered K/V, activations) its own mmap and
# returns it on free, so every step page-faults hundreds of MB afresh: measured 3x slower
# decode steps. Keep such blocks in the heap instead (the caller's environment wins).
MALLOC_TUNING = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's maximum on 64-bit
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
}
HEARTBEAT_S = 0.2  # how often the device process stamps its heartbeat
# Frame kinds: the first byte of every message.
STEP, REPLAY, SHUTDOWN, RESULT, READY, FAILED = b"S", b"R", b"Q", b"r", b"+", b"!"


class ProcessDevice(Device):
    def __init__(self, spec: DeviceSpec, start_timeout: float = 600.0) -> None:
        plan_r, plan_w = os.pipe()
        result_r, result_w = os.pipe()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**MALLOC_TUNING, **os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
        self._heartbeat, heartbeat_path = _heartbeat_page()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "streams.process_device", str(plan_r), str(result_w),
             heartbeat_path],
            pass_fds=(plan_r, result_w), env=env, cwd=root,
        )  # fmt: skip
        os.close(plan_r)
        os.close(result_w)
        _enlarge_pipe(plan_w)
        self._plan_send = Connection(plan_w, readable=False)
        self._result_recv = Connection(result_r, writable=False)
        self._closed = False
        self._plan_send.send_bytes(pickle.dumps(spec))
        try:
            if not self._result_recv.poll(start_timeout):
                self.kill()
                raise DeviceError("device process did not start in time")
            frame = self._recv()
        finally:
            os.unlink(heartbeat_path)  # both sides have it mapped; nobody needs the name
        if frame[:1] != READY:
            self.close()
            raise DeviceError(f"device process failed to start:\n{frame[1:].decode()}")
        # What the runner decided at start (a GPU runner: the KV blocks that fit).
        self.info: dict[str, Any] = pickle.loads(frame[1:]) if len(frame) > 1 else {}

    @property
    def pid(self) -> int:
        return self._proc.pid

    def heartbeat_age(self) -> float:
        (stamp,) = struct.unpack_from("d", self._heartbeat, 0)
        return time.monotonic() - stamp

    def launch(self, plan: StepPlan) -> None:
        self._send(STEP + encode_plan(plan))

    def completion_fd(self) -> int:
        return self._result_recv.fileno()

    def collect(self) -> list[StepResult]:
        results = []
        while self._result_recv.poll():
            frame = self._recv()
            if frame[:1] != RESULT:
                raise DeviceError(f"unexpected message from device: {frame[:1]!r}")
            results.append(decode_result(memoryview(frame)[1:]))
        return results

    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def launch_replay(self, plans: list[StepPlan]) -> None:
        self._send(REPLAY + pickle.dumps([encode_plan(p) for p in plans], 5))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._plan_send.send_bytes(SHUTDOWN)
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._release()

    def kill(self) -> None:
        """End the process now (a hung or stopped one cannot be asked to shut down)."""
        self._closed = True
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._release()

    def _release(self) -> None:
        self._plan_send.close()
        self._result_recv.close()

    def _send(self, frame: bytes) -> None:
        if self._closed:
            raise DeviceError("device is closed")
        try:
            self._plan_send.send_bytes(frame)
        except (BrokenPipeError, OSError) as exc:
            raise DeviceError(f"device process is gone (exit code {self._proc.poll()})") from exc

    def _recv(self) -> bytes:
        # An event loop's add_reader may switch the fd to non-blocking; a message that is
        # only partly written yet must be waited for, not torn.
        os.set_blocking(self._result_recv.fileno(), True)
        try:
            return self._result_recv.recv_bytes()
        except EOFError as exc:
            raise DeviceError(f"device process is gone (exit code {self._proc.poll()})") from exc


def _enlarge_pipe(fd: int, size: int = 1 << 20) -> None:
    """Room for many queued plans; Linux caps it at /proc/sys/fs/pipe-max-size."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except OSError:
        pass  # a smaller pipe only means launch() may wait for the device to catch up


def _heartbeat_page() -> tuple[mmap.mmap, str]:
    """A shared 8-byte page: the device stamps CLOCK_MONOTONIC (system-wide) into it."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="async-engine-heartbeat-", dir=folder)
    try:
        os.write(fd, struct.pack("d", time.monotonic()))
        return mmap.mmap(fd, 8), path
    finally:
        os.close(fd)


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
    try:
        spec: DeviceSpec = pickle.loads(plan_recv.recv_bytes())
        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        runner = spec.runner_factory()
    except Exception:
        result_send.send_bytes(FAILED + traceback.format_exc().encode())
        return
    result_send.send_bytes(READY + pickle.dumps(getattr(runner, "info", {})))
    if hasattr(runner, "launch"):
        _pipelined_loop(runner, plan_recv, result_send)
        return

    clock = PreciseClock()
    ahead: tuple[bytes, Any] | None = None  # a message read while a step ran
    while True:
        if ahead is not None:
            (kind, payload), ahead = ahead, None
        else:
            try:
                kind, payload = _read(plan_recv)
            except (EOFError, OSError):  # the control plane went away: shut down
                return
        if kind == SHUTDOWN:
            return
        try:
            if kind == STEP:
                result = runner.run(payload)
                if result.device_end > time.monotonic():
                    # A modelled step (the simulated device): like a GPU's host thread, take
                    # the next plan in while the step "runs", then finish it on time.
                    ahead = _read_ahead(plan_recv, clock, result.device_end)
            elif kind == REPLAY:
                result = runner.replay(payload)
            else:
                continue
            result_send.send_bytes(RESULT + encode_result(result))
        except (BrokenPipeError, OSError):
            return


def _pipelined_loop(runner: Any, plan_recv: Connection, result_send: Connection) -> None:
    """A runner that launches without waiting (``launch(plan) -> pending``): this thread
    reads plans and launches them; a completer thread waits for each step (``finish``, which
    releases the GIL while it waits on the device) and sends results in launch order. The
    runner's slots bound how far launching runs ahead."""
    launched: queue.Queue[Any] = queue.Queue()

    def complete() -> None:
        while True:
            pending = launched.get()
            if pending is None:
                return
            try:
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
            kind, payload = _read(plan_recv)
        except (EOFError, OSError):
            kind, payload = SHUTDOWN, None
        if kind == SHUTDOWN:
            launched.put(None)
            completer.join(timeout=30)
            return
        if kind == STEP:
            launched.put(runner.launch(payload))
        elif kind == REPLAY:
            launched.join()  # a replay runs on an idle device
            launched.put(runner.replay(payload))


def _read(plan_recv: Connection) -> tuple[bytes, Any]:
    """One message: its kind, and its decoded plan (a step) or plans (a replay)."""
    frame = plan_recv.recv_bytes()
    kind = frame[:1]
    if kind == STEP:
        return kind, decode_plan(memoryview(frame)[1:])
    if kind == REPLAY:
        return kind, [decode_plan(f) for f in pickle.loads(memoryview(frame)[1:])]
    return kind, None


def _read_ahead(
    plan_recv: Connection, clock: PreciseClock, deadline: float
) -> tuple[bytes, Any] | None:
    ahead = None
    if plan_recv.poll(max(0.0, deadline - time.monotonic() - clock.margin_s)):
        try:
            ahead = _read(plan_recv)
        except (EOFError, OSError):
            ahead = (SHUTDOWN, None)
    clock.wait_until(deadline)
    return ahead


if __name__ == "__main__":
    _device_main(
        Connection(int(sys.argv[1]), writable=False),
        Connection(int(sys.argv[2]), readable=False),
        sys.argv[3],
    )
