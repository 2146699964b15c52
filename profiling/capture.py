"""On-demand capture in a running server: trace the next N steps, write the exports, no restart.

The server calls ``attach(engine, out_dir)`` once at start-up. Then, at any time:

- ``kill -USR2 <server pid>`` captures the next ``steps`` steps (default 200), or
- ``touch OUT_DIR/capture-now`` does the same; write a number into the file to choose the
  step count (``echo 50 > OUT_DIR/capture-now``). The file is deleted when the capture starts.
  It is checked at most every ``poll_s`` seconds, and only while the engine runs steps.

Each capture goes to ``OUT_DIR/capture-<time>-<n>/`` (trace.json, timeline.png, report.txt).
Between captures the controller only reads one attribute per step (and stats the flag file
twice a second); while capturing it costs what StepTracer costs. Writing the files (mostly the
PNG, about a second of CPU) runs on a background thread so the event loop keeps serving.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from profiling.exports import write_exports
from profiling.tracer import StepTracer

log = logging.getLogger(__name__)
FLAG_NAME = "capture-now"


class CaptureController:
    """A StepObserver that forwards to the engine's previous observer and captures on demand."""

    def __init__(
        self,
        engine: Any,
        out_dir: str | Path,
        steps: int = 200,
        flag_file: str | Path | None = None,
        poll_s: float = 0.5,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be positive, got {steps}")
        self.engine = engine
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)  # the flag file lives here
        self.steps = steps
        self.flag_file = Path(flag_file) if flag_file is not None else self.out_dir / FLAG_NAME
        self.poll_s = poll_s
        self.captures: list[Path] = []  # folders whose files are fully written
        self.finished = threading.Event()  # set after each capture's files are written
        self._inner = engine.observer  # keep an observer someone else installed working
        self._requested = 0  # steps asked for by trigger(); set from any thread or a signal
        self._tracer: StepTracer | None = None
        self._first = 0
        self._last = 0
        self._next_poll = 0.0
        self._count = 0
        self._old_handler: Any = None
        self._signum: int | None = None
        engine.observer = self

    # ------------------------------------------------------------ triggers
    def trigger(self, steps: int | None = None) -> None:
        """Capture the next ``steps`` steps, from the next scheduled step on (thread-safe)."""
        self._requested = steps or self.steps

    def install_signal(self, signum: int = signal.SIGUSR2) -> None:
        """Trigger on a signal; must run on the main thread (Python's rule for handlers)."""
        self._old_handler = signal.signal(signum, lambda *_: self.trigger())
        self._signum = signum

    def detach(self) -> None:
        """Give the engine back its previous observer and the signal its previous handler."""
        if self.engine.observer is self:
            self.engine.observer = self._inner
        if self._signum is not None:
            signal.signal(self._signum, self._old_handler or signal.SIG_DFL)
            self._signum = None

    # ------------------------------------------------------------ observer
    def on_phase(self, name: str, step_id: int, start: float, end: float) -> None:
        if self._inner is not None:
            self._inner.on_phase(name, step_id, start, end)
        if self._tracer is None and name == "schedule":
            if end >= self._next_poll:
                self._next_poll = end + self.poll_s
                self._poll_flag()
            if self._requested:
                self._start(step_id)
        if self._tracer is not None:
            self._tracer.on_phase(name, step_id, start, end)

    def on_device(self, plan: Any, result: Any) -> None:
        if self._inner is not None:
            self._inner.on_device(plan, result)
        tracer = self._tracer
        if tracer is not None and result.step_id >= self._first:
            tracer.on_device(plan, result)
            if result.step_id >= self._last:
                self._finish()

    # ------------------------------------------------------------ internals
    def _poll_flag(self) -> None:
        try:
            text = self.flag_file.read_text().strip()
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return
        try:
            self.flag_file.unlink()
        except FileNotFoundError:
            pass
        try:
            steps = int(text) if text else self.steps
        except ValueError:
            log.warning(
                "%s: %r is not a step count; capturing %d steps", self.flag_file, text, self.steps
            )
            steps = self.steps
        self.trigger(max(1, steps))

    def _start(self, step_id: int) -> None:
        steps, self._requested = self._requested, 0
        self._first, self._last = step_id, step_id + steps - 1
        # Room for every span of the window, so the ring never drops the start of a capture.
        self._tracer = StepTracer(capacity=8 * steps + 64, engine=self.engine)
        log.info("capturing steps %d..%d", self._first, self._last)

    def _finish(self) -> None:
        tracer, self._tracer = self._tracer, None
        assert tracer is not None  # only called while capturing
        tracer.close()
        trace = tracer.snapshot().steps(self._first, self._last)
        self._count += 1
        folder = self.out_dir / f"capture-{time.strftime('%Y%m%d-%H%M%S')}-{self._count}"
        title = f"capture of steps {self._first}..{self._last}"
        self.finished.clear()
        threading.Thread(
            target=self._write,
            args=(trace, folder, title),
            daemon=True,
            name="profile-capture-writer",
        ).start()

    def _write(self, trace: Any, folder: Path, title: str) -> None:
        try:
            write_exports(trace, folder, title)
            self.captures.append(folder)
            log.info("wrote step capture to %s", folder)
        except Exception:  # a failed export must never take the server down
            log.exception("writing the step capture to %s failed", folder)
        finally:
            self.finished.set()


def attach(
    engine: Any,
    out_dir: str | Path,
    steps: int = 200,
    flag_file: str | Path | None = None,
    signum: int | None = signal.SIGUSR2,
) -> CaptureController:
    """Install a CaptureController on a running engine (see module doc). The signal handler is
    only installed from the main thread; elsewhere, pass signum=None and use the flag file."""
    controller = CaptureController(engine, out_dir, steps, flag_file)
    if signum is not None:
        if threading.current_thread() is not threading.main_thread():
            controller.detach()
            raise ValueError("signum: signal handlers can only be installed from the main thread")
        controller.install_signal(signum)
    return controller
