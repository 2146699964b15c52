"""CUDA device: steps run on a dedicated compute stream, driven by one worker thread.

Kernel launches are asynchronous, so the worker spends its time waiting on CUDA events
(which releases the GIL) rather than competing with the control plane for it. Sampled
tokens are copied into pinned host memory on the stream; completion is signalled through
an os.pipe the control plane's event loop watches, exactly like the CPU device.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque

import torch

from streams.device import REPLAY_STEP, Device, DeviceSpec
from streams.plan import StepPlan, StepResult


class CudaDevice(Device):
    def __init__(self, spec: DeviceSpec) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but torch sees no CUDA device")
        from streams.runner import ModelRunner

        self.device = torch.device("cuda")
        self.compute = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.compute):
            model = spec.model_factory()
            self.runner = ModelRunner(
                model, spec.num_blocks, spec.block_size, self.device, spec.fail_on_token_id
            )
        self.compute.synchronize()
        self.info = {"vocab_size": model.cfg.vocab_size, "device": torch.cuda.get_device_name()}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[StepResult] = deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._closed = False
        self._worker = threading.Thread(target=self._work, daemon=True, name="cuda-device")
        self._worker.start()

    def launch(self, plan: StepPlan) -> None:
        if self._closed:
            raise RuntimeError("device is closed")
        self._inbox.put(plan)

    def completion_fd(self) -> int:
        return self._read_fd

    def collect(self) -> list[StepResult]:
        try:
            os.read(self._read_fd, 4096)
        except BlockingIOError:
            pass
        results = []
        while self._done:
            results.append(self._done.popleft())
        return results

    def alive(self) -> bool:
        return not self._closed and self._worker.is_alive()

    def launch_replay(self, plans: list[StepPlan]) -> None:
        if self._closed:
            raise RuntimeError("device is closed")
        self._inbox.put(plans)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._worker.join(timeout=10)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _work(self) -> None:
        while True:
            plan = self._inbox.get()
            if plan is None:
                return
            with torch.cuda.stream(self.compute):
                if isinstance(plan, list):  # a replay: recorded plans back to back
                    start = time.monotonic()
                    for step in plan:
                        self.runner.run(step)
                    self.compute.synchronize()
                    result = StepResult(REPLAY_STEP, [], None, None, start, time.monotonic())
                else:
                    result = self.runner.run(plan)  # tokens reach the host through one sync
            self._done.append(result)
            try:
                os.write(self._write_fd, b"\x01")
            except OSError:
                return
