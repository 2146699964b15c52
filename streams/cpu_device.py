"""CPU device: a process that owns the weights and the KV cache.

A forward pass on a thread of the control plane's process stalls whenever the control
plane runs Python (every eager op needs the GIL), so the CPU "device" is a separate
process. Plans arrive over one pipe and results leave over another; the control plane's
event loop watches the result pipe. The plan pipe is enlarged so that ``launch`` never
blocks on a busy device, and the device reads it on its own main thread between steps: a
receiver thread would need the GIL and a free core to hand a plan over, and on a 2-core
machine with busy torch threads that handoff cost about a millisecond per step.

The process is a fresh interpreter (``python -m streams.cpu_device``), not a
multiprocessing child: the caller's ``__main__`` is never re-imported, so scripts need no
``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from streams.device import REPLAY_STEP, Device, DeviceError, DeviceSpec
from streams.plan import StepPlan, StepResult

# glibc hands each multi-megabyte temporary (gathered K/V, activations) its own mmap and
# returns it on free, so every step page-faults hundreds of MB afresh: measured 3x slower
# decode steps. Keep such blocks in the heap instead (the caller's environment wins).
MALLOC_TUNING = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's maximum on 64-bit
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "MALLOC_TOP_PAD_": str(256 << 20),
}


class ProcessDevice(Device):
    def __init__(self, spec: DeviceSpec, start_timeout: float = 600.0) -> None:
        plan_r, plan_w = os.pipe()
        result_r, result_w = os.pipe()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**MALLOC_TUNING, **os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "streams.cpu_device", str(plan_r), str(result_w)],
            pass_fds=(plan_r, result_w), env=env, cwd=root,
        )  # fmt: skip
        os.close(plan_r)
        os.close(result_w)
        _enlarge_pipe(plan_w)
        self._plan_send = Connection(plan_w, readable=False)
        self._result_recv = Connection(result_r, writable=False)
        self._plan_send.send(spec)
        self._closed = False
        if not self._result_recv.poll(start_timeout):
            self.close()
            raise DeviceError("device process did not start in time")
        kind, payload = self._recv()
        if kind != "ready":
            self.close()
            raise DeviceError(f"device process failed to start:\n{payload}")
        self.info: dict = payload

    def launch(self, plan: StepPlan) -> None:
        self._send(("step", plan))

    def completion_fd(self) -> int:
        return self._result_recv.fileno()

    def collect(self) -> list[StepResult]:
        results = []
        while self._result_recv.poll():
            kind, payload = self._recv()
            if kind != "result":
                raise DeviceError(f"unexpected message from device: {kind}")
            results.append(payload)
        return results

    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def launch_replay(self, plans: list[StepPlan]) -> None:
        self._send(("replay", plans))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._plan_send.send(("shutdown", None))
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._plan_send.close()
        self._result_recv.close()

    def _send(self, message: tuple) -> None:
        if self._closed:
            raise DeviceError("device is closed")
        try:
            self._plan_send.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise DeviceError(f"device process is gone (exit code {self._proc.poll()})") from exc

    def _recv(self) -> tuple:
        # An event loop's add_reader may switch the fd to non-blocking; a message that is
        # only partly written yet must be waited for, not torn.
        os.set_blocking(self._result_recv.fileno(), True)
        try:
            return self._result_recv.recv()
        except EOFError as exc:
            raise DeviceError(f"device process is gone (exit code {self._proc.poll()})") from exc


def _enlarge_pipe(fd: int, size: int = 1 << 20) -> None:
    """Room for many queued plans; Linux caps it at /proc/sys/fs/pipe-max-size."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except OSError:
        pass  # a smaller pipe only means launch() may wait for the device to catch up


def _device_main(plan_recv: Connection, result_send: Connection) -> None:
    import torch

    from streams.runner import ModelRunner

    try:
        spec: DeviceSpec = plan_recv.recv()
        torch.set_num_threads(spec.threads)
        model = spec.model_factory()
        runner = ModelRunner(model, spec.num_blocks, spec.block_size, "cpu", spec.fail_on_token_id)
    except Exception:
        result_send.send(("error", traceback.format_exc()))
        return
    result_send.send(("ready", {"vocab_size": model.cfg.vocab_size, "threads": spec.threads}))

    while True:
        try:
            kind, payload = plan_recv.recv()
        except (EOFError, OSError):  # the control plane went away: shut down
            return
        if kind == "shutdown":
            return
        try:
            if kind == "step":
                result_send.send(("result", runner.run(payload)))
            elif kind == "replay":
                start = time.monotonic()
                for plan in payload:
                    runner.run(plan)
                result_send.send(("result", StepResult(REPLAY_STEP, [], None, None, start,
                                                       time.monotonic())))  # fmt: skip
        except (BrokenPipeError, OSError):
            return


if __name__ == "__main__":
    _device_main(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
