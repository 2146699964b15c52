"""Tables and the latency-vs-load plot of `async-engine bench serve`."""

from __future__ import annotations

from typing import Any

from async_engine.bench.load import Slo


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1000:.0f}"  # NaN: no sample


def print_table(title: str, sweep: dict[str, Any]) -> None:
    print(f"\n== {title}")
    head = (
        f"{'rate':>6} {'req/s':>6} {'tok/s':>7} {'goodput':>7} | {'TTFT p50/p95/p99 ms':>19} | "
        f"{'TPOT p50/p95':>12} | {'ITL p50/p95/p99':>15} | {'E2E p50/p95':>12} | abort lag ms"
    )
    print(head)
    for rate, s in sorted(sweep["runs"].items()):
        t, p, i, e = s["ttft_s"], s["tpot_s"], s["itl_s"], s["e2e_s"]
        lag = s["abort_lag_s"]
        print(
            f"{rate:>6g} {s['request_throughput']:>6.2f} {s['output_tokens_per_s']:>7.1f} "
            f"{s['goodput']:>7.2f} | {_ms(t['p50']):>5}/{_ms(t['p95']):>5}/{_ms(t['p99']):>5}     | "
            f"{_ms(p['p50']):>5}/{_ms(p['p95']):>5}  | {_ms(i['p50']):>4}/{_ms(i['p95']):>4}/{_ms(i['p99']):>5} | "
            f"{_ms(e['p50']):>5}/{_ms(e['p95']):>6} | {_ms(lag.get('mean', float('nan')))}"
            + _server_idle(s)
        )
    cap = sweep.get("capacity")
    if cap is not None:
        s = cap["at_limit"]
        print(
            f"operating limit: {cap['rate']:g} req/s (p95 TTFT {_ms(s['ttft_s']['p95'])} ms, "
            f"p95 ITL {_ms(s['itl_s']['p95'])} ms); first failing rate: {cap['first_failing_rate']}"
        )


def _server_idle(summary: dict[str, Any]) -> str:
    idle = summary.get("server_device_idle")
    if idle is None or idle != idle:  # absent, or NaN without a metrics port
        return ""
    errors = summary.get("errors", 0)
    phases = summary.get("server_phase_ms_per_step") or {}
    shown = ", ".join(f"{name} {ms:.3f}" for name, ms in phases.items())
    per_step = f" | server ms/step: {shown}" if shown else ""
    return f" | device idle {idle:.1%}, {summary['completed']} complete, {errors} errors{per_step}"


def write_plot(out: dict[str, Any], path: str, slo: Slo) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("grpc", "openai", "inprocess"):
        if name not in out:
            continue
        runs = sorted(out[name]["runs"].items())
        rates = [r for r, _ in runs]
        for q, style in (("p50", "-o"), ("p95", "--s")):
            ax_ttft.plot(
                rates, [s["ttft_s"][q] * 1000 for _, s in runs], style, label=f"{name} {q}"
            )
            ax_itl.plot(rates, [s["itl_s"][q] * 1000 for _, s in runs], style, label=f"{name} {q}")
    ax_ttft.axhline(slo.ttft_s * 1000, color="red", lw=0.8, label="SLO")
    ax_itl.axhline(slo.itl_s * 1000, color="red", lw=0.8, label="SLO")
    for ax, title in ((ax_ttft, "TTFT"), (ax_itl, "inter-token latency")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
