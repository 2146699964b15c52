"""Step timeline tracer, idle-gap report, Chrome/PNG exports, nsys import, on-demand capture.

Runtime code never imports this package: whoever starts an engine injects a tracer with
``StepTracer.attach(engine)`` (or ``profiling.capture.attach`` in a server).
"""

from profiling.report import Report, analyze
from profiling.trace import DeviceSpan, PhaseSpan, Trace
from profiling.tracer import StepTracer

__all__ = ["DeviceSpan", "PhaseSpan", "Report", "StepTracer", "Trace", "analyze"]
