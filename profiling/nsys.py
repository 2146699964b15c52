"""Read an Nsight Systems SQLite export (``nsys export --type sqlite``) into a Trace.

Uses nsys's documented schema: ``CUPTI_ACTIVITY_KIND_KERNEL`` (start, end in ns) gives the
device's busy time from the kernels' own timestamps; ``NVTX_EVENTS`` (start, end, text, or
textId -> ``StringIds.value`` in newer nsys versions) gives the control-plane phase ranges
our tracer emits under the same names. Kernels on every device and stream count as busy: the
report is about whether *anything* ran.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from async_engine.core.observer import PHASES
from profiling.trace import DeviceSpan, PhaseSpan, Trace

KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
NVTX_TABLE = "NVTX_EVENTS"


def load_nsys(path: str | Path) -> Trace:
    """Kernels become device spans (overlapping ones merge in the report); NVTX ranges named
    like our phases become phase spans. Raises ValueError for a file that is not an export."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{path}: not an SQLite file ({exc})") from None
    try:
        if KERNEL_TABLE not in tables:
            raise ValueError(
                f"{path}: no {KERNEL_TABLE} table; capture with `nsys profile -t cuda,...` "
                "and make sure kernels ran inside the capture range"
            )
        rows = con.execute(f"SELECT start, end FROM {KERNEL_TABLE} ORDER BY start").fetchall()
        device = [DeviceSpan(i, s / 1e9, e / 1e9) for i, (s, e) in enumerate(rows)]
        phases = _nvtx_phases(con) if NVTX_TABLE in tables else []
    finally:
        con.close()
    return Trace(phases, device, source="nsys").sorted()


def _nvtx_phases(con: sqlite3.Connection) -> list[PhaseSpan]:
    columns = {row[1] for row in con.execute(f"PRAGMA table_info({NVTX_TABLE})")}
    if "textId" in columns:
        name = "COALESCE(n.text, s.value)"
        join = "LEFT JOIN StringIds AS s ON n.textId = s.id"
    else:
        name, join = "n.text", ""
    # Ranges only: marks have no (or a zero) end.
    query = (
        f"SELECT n.start, n.end, {name} FROM {NVTX_TABLE} AS n {join} "
        "WHERE n.end IS NOT NULL AND n.end > n.start"
    )
    wanted = set(PHASES)
    return [
        PhaseSpan(text, -1, start / 1e9, end / 1e9)
        for start, end, text in con.execute(query)
        if text in wanted
    ]
