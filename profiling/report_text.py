"""The text report, and the side-by-side table of overlap on vs off."""

from __future__ import annotations

import math

from profiling.report import BLOCKING_PHASES, DEVICE_SIDE, UNTRACED, Report

LEGEND = (
    f"  '{DEVICE_SIDE}': the next step was already launched when the gap began, so the device\n"
    "    waited on itself (result send, plan receive, IPC inside the device), not on us;\n"
    f"  '{UNTRACED}': no control-plane phase ran (event-loop wake-up, IPC, GIL, untraced work);\n"
    "  'wait': the control plane was already blocked on the step's result (result hand-off)."
)


def pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f} %"


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{1e3 * seconds:.2f}"


def cpu_per_step(report: Report) -> tuple[float, float]:
    """Control-plane compute per step in seconds (blocking phases excluded), hidden share."""
    work = [p for p in report.phases if p.name not in BLOCKING_PHASES]
    total = sum(p.total_s for p in work)
    steps = max((p.steps for p in work), default=0)
    hidden = sum(p.hidden_s for p in work)
    return (total / steps if steps else float("nan"), hidden / total if total else float("nan"))


def format_report(report: Report, title: str = "", extra: dict[str, str] | None = None) -> str:
    unit = "kernels" if report.source == "nsys" else "steps"  # nsys spans are kernels
    lines = [
        f"== {title or 'step trace'} ({report.source}, {report.steps} {unit}, "
        f"window {report.window_s:.3f} s) =="
    ]
    for key, value in (extra or {}).items():
        lines.append(f"{key}: {value}")
    lines += [
        f"device busy {pct(report.busy_fraction)}, idle {pct(report.idle_fraction)} "
        f"(busy {report.busy_s:.3f} s, idle {report.idle_s:.3f} s; "
        f"engine without work {report.engine_idle_s:.3f} s, not counted)",
        f"steady decode: idle {pct(report.decode_idle_fraction)} over "
        f"{report.decode_pairs} step pairs",
    ]
    if report.mean_batch:
        lines.append(
            f"tokens computed {report.tokens} (prefill {report.prefill_tokens}, decode "
            f"{report.decode_tokens}), mean batch {report.mean_batch:.1f}"
        )
    lines += ["", "idle gaps          count    p50 ms    p95 ms    max ms"]
    for label, decode_only in (("all", False), ("steady decode", True)):
        n, p50, p95, top = report.gap_stats(decode_only)
        lines.append(f"  {label:<15}{n:>6}  {ms(p50):>8}  {ms(p95):>8}  {ms(top):>8}")
    lines += ["", "who the device waited on (idle-gap time by cause)"]
    blame_s, counts = report.blame_seconds(), report.blame_counts()
    total = sum(blame_s.values())
    lines.append(f"  {'cause':<13}{'gap ms':>10}{'share':>9}{'gaps blamed':>13}")
    for name, seconds in blame_s.items():
        share = seconds / total if total else float("nan")
        lines.append(f"  {name:<13}{ms(seconds):>10}{pct(share):>9}{counts.get(name, 0):>13}")
    if not blame_s:
        lines.append("  (no idle gaps)")
    lines += [LEGEND, "", "control plane per step"]
    lines.append(
        f"  {'phase':<10}{'steps':>7}{'mean ms':>9}{'p50 ms':>9}{'p95 ms':>9}"
        f"{'total s':>9}{'hidden':>9}"
    )
    for p in report.phases:
        mean, p50, p95 = p.per_step_ms
        note = "  (blocked on the device)" if p.name in BLOCKING_PHASES else ""
        lines.append(
            f"  {p.name:<10}{p.steps:>7}{mean:>9.2f}{p50:>9.2f}{p95:>9.2f}"
            f"{p.total_s:>9.3f}{pct(p.hidden_fraction):>9}{note}"
        )
    per_step, hidden = cpu_per_step(report)
    lines.append(
        f"  control-plane work (without wait): {ms(per_step)} ms/step, "
        f"{pct(hidden)} hidden behind device busy time"
    )
    return "\n".join(lines) + "\n"


def format_compare(on: Report, off: Report, extra: dict[str, tuple[str, str]] | None = None) -> str:
    """Overlap on vs off side by side, ending with the steady-decode idle ratio."""

    def gaps(r: Report) -> str:
        n, p50, p95, top = r.gap_stats()
        return f"{n} / {ms(p50)} / {ms(p95)} / {ms(top)}"

    def blame(r: Report) -> str:
        seconds = r.blame_seconds()
        if not seconds:
            return "-"
        name, value = next(iter(seconds.items()))
        return f"{name} {pct(value / sum(seconds.values()))}"

    rows = [("steps", str(on.steps), str(off.steps))]
    rows += [(key, *values) for key, values in (extra or {}).items()]
    rows += [
        ("device idle (all steps)", pct(on.idle_fraction), pct(off.idle_fraction)),
        (
            "device idle (steady decode)",
            pct(on.decode_idle_fraction),
            pct(off.decode_idle_fraction),
        ),
        ("gaps n / p50 / p95 / max ms", gaps(on), gaps(off)),
        ("gap time mostly blamed on", blame(on), blame(off)),
        ("control-plane work ms/step", ms(cpu_per_step(on)[0]), ms(cpu_per_step(off)[0])),
        ("... hidden behind the device", pct(cpu_per_step(on)[1]), pct(cpu_per_step(off)[1])),
    ]
    width = max(len(r[0]) for r in rows) + 2
    col = max(14, *(len(r[1]) + 2 for r in rows), *(len(r[2]) + 2 for r in rows))
    lines = [f"{'':<{width}}{'overlap on':>{col}}{'overlap off':>{col}}"]
    lines += [f"{a:<{width}}{b:>{col}}{c:>{col}}" for a, b, c in rows]
    ratio = on.decode_idle_fraction / off.decode_idle_fraction if off.decode_idle_fraction else 0.0
    verdict = "meets" if ratio <= 0.25 else "misses"
    lines.append(
        f"steady-decode idle, on / off = {ratio:.3f} ({verdict} the target of at most 0.25)"
    )
    return "\n".join(lines) + "\n"
