"""The device process: a separate interpreter that owns the runner (weights and KV cache).

A forward pass on a thread of the control plane's process stalls whenever the control
plane runs Python (every eager op needs the GIL), so every device runs in its own process:
the CPU model, the simulated device, and the CUDA model alike. Plans arrive as flat byte
frames over one pipe and results leave over another; the control plane's event loop
watches the result pipe. The plan pipe is enlarged so that ``launch`` never blocks on a
busy device, and the device reads it on its own main thread between steps: a receiver
thread would need the GIL and a free core to hand a plan over, and on a 2-core machine
with busy torch threads that handoff cost about a millisecond per step.

The process is a fresh interpreter (``python -m streams.device_loop``), not a
multiprocessing child: the caller's ``__main__`` is never re-imported, so scripts need no
``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from streams.device import Device, DeviceError, DeviceSpec
from streams.plan import StepPlan, StepResult
from streams.wire import (
    READY,
    REPLAY,
    RESULT,
    SHUTDOWN,
    STEP,
    decode_result,
    encode_plan,
)

# glibc hands each multi-megabyte temporary (gathered K/V, activations, logits) its own mmap
# and returns it on free, so every step page-faults hundreds of MB afresh: measured 3x slower
# decode steps. The device process raises the mmap threshold (``streams.heap``); these keep
# the heap from shrinking back between steps (the caller's environment wins).
MALLOC_TUNING = {
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
}


class ProcessDevice(Device):
    def __init__(self, spec: DeviceSpec, start_timeout: float = 600.0) -> None:
        plan_r, plan_w = os.pipe()
        result_r, result_w = os.pipe()
        root = str(Path(__file__).resolve().parent.parent)
        env = {
            **MALLOC_TUNING,
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        self._heartbeat, heartbeat_path = _heartbeat_page()
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streams.device_loop",
                str(plan_r),
                str(result_w),
                heartbeat_path,
            ],
            pass_fds=(plan_r, result_w),
            env=env,
            cwd=root,
        )
        os.close(plan_r)
        os.close(result_w)
        _enlarge_pipe(plan_w)
        self._plan_send = Connection(plan_w, readable=False)
        self._result_recv = Connection(result_r, writable=False)
        # Polled several times a step: one poll object, not Connection.poll's new selector
        # (about 10 us a call, a few percent of the loop at batch 1,024).
        self._results_ready = select.poll()
        self._results_ready.register(result_r, select.POLLIN)
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
        while self._results_ready.poll(0):
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
