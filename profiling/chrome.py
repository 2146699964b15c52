"""Chrome trace JSON (Trace Event Format): opens in Perfetto (ui.perfetto.dev) and chrome://tracing.

Complete events (ph "X", ts/dur in microseconds from the trace's first timestamp) on three
tracks of one process: the control plane, the device, and the device's idle gaps labelled with
the phase they are blamed on. ``otherData.origin_s`` keeps the monotonic-clock origin so that
``load_chrome`` gives back the seconds the tracer recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from profiling.report import Gap
from profiling.trace import DeviceSpan, PhaseSpan, Trace

FORMAT = "async-engine-trace/1"
PID = 1
TRACKS = {"control plane": 1, "device": 2, "device idle": 3}
DEVICE_ARGS = ("batch", "tokens", "prefill_tokens", "decode_tokens", "after_idle")


def to_chrome(trace: Trace, gaps: list[Gap] | None = None) -> dict[str, Any]:
    origin = trace.origin

    def event(name: str, cat: str, tid: int, start: float, end: float, args: dict) -> dict:
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": PID,
            "tid": tid,
            "ts": (start - origin) * 1e6,
            "dur": (end - start) * 1e6,
            "args": args,
        }

    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "async-engine"}}
    ]
    for name, tid in TRACKS.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": PID,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    for p in trace.phases:
        events.append(
            event(p.name, "control", TRACKS["control plane"], p.start, p.end, {"step": p.step})
        )
    for d in trace.device:
        args = {"step": d.step, **{k: getattr(d, k) for k in DEVICE_ARGS}, "kind": _kind(d)}
        events.append(event(f"step {d.step}", "device", TRACKS["device"], d.start, d.end, args))
    for g in gaps or []:
        args = {
            "blame": g.blame,
            "after_step": g.prev_step,
            "before_step": g.next_step,
            "overlaps_ms": {k: v * 1e3 for k, v in g.overlaps.items()},
        }
        events.append(event(f"idle: {g.blame}", "gap", TRACKS["device idle"], g.start, g.end, args))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"format": FORMAT, "origin_s": origin, "source": trace.source},
    }


def _kind(d: DeviceSpan) -> str:
    if d.batch == 0:
        return "unknown"
    if d.is_decode:
        return "decode"
    return "prefill" if d.decode_tokens == 0 else "mixed"


def write_chrome(trace: Trace, path: str | Path, gaps: list[Gap] | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_chrome(trace, gaps)))
    return path


def from_chrome(data: dict[str, Any]) -> Trace:
    """The trace a ``to_chrome`` document came from (gap events are derived, so skipped)."""
    problems = validate(data)
    if problems:
        raise ValueError("not a valid trace: " + "; ".join(problems[:5]))
    other = data.get("otherData", {})
    origin = float(other.get("origin_s", 0.0))
    trace = Trace(source=other.get("source", "chrome"))
    for e in data["traceEvents"]:
        if e["ph"] != "X":
            continue
        start = origin + e["ts"] / 1e6
        end = start + e["dur"] / 1e6
        args = e.get("args", {})
        if e.get("cat") == "control":
            trace.phases.append(PhaseSpan(e["name"], int(args.get("step", -1)), start, end))
        elif e.get("cat") == "device":
            extra = [args.get(k, 0) for k in DEVICE_ARGS]
            trace.device.append(
                DeviceSpan(
                    int(args.get("step", -1)), start, end, *map(int, extra[:4]), bool(extra[4])
                )
            )
    return trace.sorted()


def load_chrome(path: str | Path) -> Trace:
    return from_chrome(json.loads(Path(path).read_text()))


def validate(data: Any) -> list[str]:
    """Problems that would stop Perfetto or chrome://tracing reading the document."""
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        return ["top level must be an object with a traceEvents list"]
    problems = []
    for i, e in enumerate(data["traceEvents"]):
        if not isinstance(e, dict):
            problems.append(f"event {i} is not an object")
            continue
        for key, kind in (("name", str), ("ph", str), ("pid", int), ("tid", int)):
            if not isinstance(e.get(key), kind):
                problems.append(f"event {i}: {key} must be {kind.__name__}")
        if e.get("ph") == "X":
            for key in ("ts", "dur"):
                value = e.get(key)
                if not isinstance(value, int | float) or isinstance(value, bool):
                    problems.append(f"event {i}: {key} must be a number")
                elif key == "dur" and value < 0:
                    problems.append(f"event {i}: negative dur")
        elif e.get("ph") != "M":
            problems.append(f"event {i}: unexpected ph {e.get('ph')!r}")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"event {i}: args must be an object")
    return problems
