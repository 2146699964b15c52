"""Write the three exports of a trace into a folder: trace.json, timeline.png, report.txt."""

from __future__ import annotations

from pathlib import Path

from profiling.chrome import write_chrome
from profiling.plot import plot_timeline
from profiling.report import Report, analyze
from profiling.report_text import format_report
from profiling.trace import Trace

FILES = ("trace.json", "timeline.png", "report.txt")


def write_exports(
    trace: Trace,
    out_dir: str | Path,
    title: str = "",
    report: Report | None = None,
    extra: dict[str, str] | None = None,
) -> str:
    """Write the files and return the text report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = report or analyze(trace)
    text = format_report(report, title, extra)
    write_chrome(trace, out / "trace.json", report.gaps)
    plot_timeline(trace, report, out / "timeline.png", title)
    (out / "report.txt").write_text(text)
    return text
