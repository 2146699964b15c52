"""PNG pictures of a trace: the whole window, a zoom on steady decode, the idle-gap histogram.

Uses matplotlib's object API with the Agg canvas (no pyplot state), so a capture thread in a
running server can draw without a display and without touching a global figure.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from profiling.report import Report
from profiling.trace import Trace

PHASE_ROWS = ("schedule", "launch", "wait", "apply", "stream")
PHASE_COLORS = {
    "schedule": "#1f77b4",
    "launch": "#ff7f0e",
    "wait": "#b0b0b0",
    "apply": "#2ca02c",
    "stream": "#9467bd",
}
KIND_COLORS = {"decode": "#17607a", "prefill": "#8c564b", "mixed": "#bcbd22", "unknown": "#555"}
GAP_COLOR = "#d62728"
ZOOM_STEPS = 6


def _kind(d) -> str:
    if d.batch == 0:
        return "unknown"
    return "decode" if d.is_decode else ("prefill" if d.decode_tokens == 0 else "mixed")


def zoom_window(trace: Trace, steps: int = ZOOM_STEPS) -> tuple[float, float]:
    """A few consecutive steps from the middle of steady decode (or of the trace)."""
    device = trace.device
    if not device:
        return (0.0, 1.0)
    decode = [i for i, d in enumerate(device) if d.is_decode] or list(range(len(device)))
    first = decode[len(decode) // 2]
    first = max(0, min(first, len(device) - steps))
    last = min(len(device) - 1, first + steps - 1)
    return device[first].start, device[last].end


def _draw_rows(ax, trace: Trace, report: Report, t0: float, t1: float, origin: float) -> None:
    rows = ["device", *PHASE_ROWS]
    height = 0.7

    def bars(row: int, spans: list[tuple[float, float]], color: str) -> None:
        clipped = [(max(s, t0), min(e, t1)) for s, e in spans if e > t0 and s < t1]
        xs = [((s - origin) * 1e3, (e - s) * 1e3) for s, e in clipped]
        if xs:
            # An edge keeps sub-pixel spans (a 0.1 ms phase on a 300 ms axis) visible.
            ax.broken_barh(
                xs, (row - height / 2, height), facecolors=color, edgecolors=color, linewidth=0.6
            )

    for kind, color in KIND_COLORS.items():
        bars(0, [(d.start, d.end) for d in trace.device if _kind(d) == kind], color)
    bars(0, [(g.start, g.end) for g in report.gaps], GAP_COLOR)
    for row, name in enumerate(PHASE_ROWS, start=1):
        bars(row, [(p.start, p.end) for p in trace.phases if p.name == name], PHASE_COLORS[name])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_xlim((t0 - origin) * 1e3, (t1 - origin) * 1e3)
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)


def _draw_histogram(ax, entries: list[tuple[str, Report]]) -> None:
    data = [[g.seconds * 1e3 for g in r.gaps] for _, r in entries]
    labels = [label for label, _ in entries]
    if any(data):
        ax.hist([d for d in data], bins=40, label=labels, alpha=0.8, histtype="stepfilled")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no idle gaps", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("idle gap (ms)")
    ax.set_ylabel("gaps")
    ax.set_title("idle-gap histogram", fontsize=10)


def _legend(fig: Figure) -> None:
    handles = [
        Patch(color=c, label=f"device {k}") for k, c in KIND_COLORS.items() if k != "unknown"
    ]
    handles.append(Patch(color=GAP_COLOR, label="device idle gap"))
    handles += [Patch(color=c, label=n) for n, c in PHASE_COLORS.items()]
    fig.legend(
        handles=handles, loc="outside lower center", ncol=len(handles), fontsize=7, frameon=False
    )


def plot_timeline(trace: Trace, report: Report, path: str | Path, title: str = "") -> Path:
    fig = Figure(figsize=(14, 9), layout="constrained")
    grid = fig.add_gridspec(3, 1, height_ratios=[1.2, 1.6, 1.0])
    origin = trace.origin
    end = max((d.end for d in trace.device), default=origin + 1)
    whole = fig.add_subplot(grid[0])
    _draw_rows(whole, trace, report, origin, end, origin)
    whole.set_title(
        f"{title} whole window: device idle {100 * report.idle_fraction:.1f} %", fontsize=10
    )
    t0, t1 = zoom_window(trace)
    zoom = fig.add_subplot(grid[1])
    _draw_rows(zoom, trace, report, t0, t1, origin)
    zoom.set_title(
        f"zoom: {ZOOM_STEPS} steady-decode steps "
        f"(steady-decode idle {100 * report.decode_idle_fraction:.1f} %)",
        fontsize=10,
    )
    _draw_histogram(fig.add_subplot(grid[2]), [(title or "gaps", report)])
    _legend(fig)
    return _save(fig, path)


def plot_compare(entries: list[tuple[str, Trace, Report]], path: str | Path) -> Path:
    """One zoom per mode on the same time span, so the gaps compare at a glance."""
    fig = Figure(figsize=(14, 3.2 * len(entries) + 3), layout="constrained")
    grid = fig.add_gridspec(len(entries) + 1, 1)
    windows = [zoom_window(trace) for _, trace, _ in entries]
    span = max(t1 - t0 for t0, t1 in windows)
    for row, ((label, trace, report), (t0, _)) in enumerate(zip(entries, windows, strict=True)):
        ax = fig.add_subplot(grid[row])
        _draw_rows(ax, trace, report, t0, t0 + span, t0)
        ax.set_title(
            f"{label}: steady-decode idle {100 * report.decode_idle_fraction:.1f} %, "
            f"all steps {100 * report.idle_fraction:.1f} %",
            fontsize=10,
        )
    _draw_histogram(fig.add_subplot(grid[len(entries)]), [(e[0], e[2]) for e in entries])
    _legend(fig)
    return _save(fig, path)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path
