"""CPU device: a process that owns the weights and the KV cache.

A forward pass on a thread of the control plane's process stalls whenever the control
plane runs Python (every eager op needs the GIL), so the CPU "device" is a separate
process. Plans arrive over one pipe and results leave over another; the control plane's
event loop watches the result pipe. A receiver thread in the device drains the plan pipe
so that ``launch`` never blocks on a busy device.

The process is a fresh interpreter (``python -m streams.cpu_device``), not a
multiprocessing child: the caller's ``__main__`` is never re-imported, so scripts need no
``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from streams.device import Device, DeviceSpec
from streams.plan import StepPlan, StepResult


class DeviceError(RuntimeError):
    pass


class ProcessDevice(Device):
    def __init__(self, spec: DeviceSpec, start_timeout: float = 600.0) -> None:
        plan_r, plan_w = os.pipe()
        result_r, result_w = os.pipe()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "streams.cpu_device", str(plan_r), str(result_w)],
            pass_fds=(plan_r, result_w), env=env, cwd=root,
        )  # fmt: skip
        os.close(plan_r)
        os.close(result_w)
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

    def replay(self, plans: list[StepPlan]) -> float:
        self._send(("replay", plans))
        while True:
            kind, payload = self._recv()
            if kind == "replayed":
                return payload
            if kind == "error":
                raise DeviceError(payload)

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

    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        try:
            while True:
                message = plan_recv.recv()
                inbox.put(message)
                if message[0] == "shutdown":
                    return
        except (EOFError, OSError):  # the control plane went away: shut down
            inbox.put(("shutdown", None))

    threading.Thread(target=receive, daemon=True, name="plan-receiver").start()
    while True:
        kind, payload = inbox.get()
        if kind == "shutdown":
            return
        try:
            if kind == "step":
                result_send.send(("result", runner.run(payload)))
            elif kind == "replay":
                start = time.perf_counter()
                for plan in payload:
                    runner.run(plan)
                result_send.send(("replayed", time.perf_counter() - start))
        except (BrokenPipeError, OSError):
            return


if __name__ == "__main__":
    _device_main(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
