"""The table `bench offline` prints: each run's throughput, overlap on vs off, the roofline,
the peers (HF, llama-server, vLLM), device idle and control-plane time per step by phase."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def print_table(
    results: dict[str, Any],
    hf: dict[str, float] | None,
    roofline: str = "roofline",
    peers: Sequence[dict[str, Any]] = (),
    cpu: str | None = None,
) -> None:
    """``peers``: other engines' runs of the workload (name, tokens_per_s, detail).
    ``cpu``: the line naming the CPU, its flags and the kernels' ISA (cpu_info.describe),
    printed above the figures it qualifies."""
    if cpu is not None:
        print(cpu)
    cols = list(results)
    width = max(24, *(len(c) + 2 for c in cols))
    label = max([28, *(len(f"overlap on / {p['name']}") + 2 for p in peers)])
    print(f"{'':<{label}}" + "".join(f"{c:>{width}}" for c in cols))

    def row(name: str, fmt: str, values: list[float]) -> None:
        print(f"{name:<{label}}" + "".join(f"{format(v, fmt):>{width}}" for v in values))

    get = [results[c] for c in cols]
    row("tokens/s, overlap on", ".1f", [r["on_tokens_per_s"] for r in get])
    row("tokens/s, overlap off", ".1f", [r["off_tokens_per_s"] for r in get])
    row(f"tokens/s, {roofline}", ".1f", [r["roofline_tokens_per_s"] for r in get])
    row("overlap on / off", ".2f", [r["on_tokens_per_s"] / r["off_tokens_per_s"] for r in get])
    row(
        f"overlap on / {roofline}",
        ".1%",
        [r["on_tokens_per_s"] / r["roofline_tokens_per_s"] for r in get],
    )
    if hf is not None:
        row("overlap on / HF", ".2f", [r["on_tokens_per_s"] / hf["tokens_per_s"] for r in get])
    for peer in peers:
        ratios = [r["on_tokens_per_s"] / peer["tokens_per_s"] for r in get]
        row(f"overlap on / {peer['name']}", ".2f", ratios)
    row("steady-decode idle, on", ".2%", [r["on_steady_decode_idle"] for r in get])
    row("steady-decode idle, off", ".2%", [r["off_steady_decode_idle"] for r in get])
    row("device idle, on", ".2%", [r["on_idle"] for r in get])
    row("device idle, off", ".2%", [r["off_idle"] for r in get])
    row("ms per step, on", ".3f", [r["on_ms_per_step"] for r in get])
    row("ms per step, off", ".3f", [r["off_ms_per_step"] for r in get])
    row(
        "overlap off costs ms/step",
        ".3f",
        [r["off_ms_per_step"] - r["on_ms_per_step"] for r in get],
    )
    for mode in ("on", "off"):
        for phase in ("schedule", "launch", "wait", "apply", "stream"):
            values = [r[f"{mode}_phase_ms"].get(phase, 0.0) for r in get]
            row(f"  {phase} ms/step, {mode}", ".3f", values)
    row("control ms/decode step, on", ".3f", [r["on_decode_control_ms"] for r in get])
    row("wasted tokens, on", "d", [r["on_wasted_tokens"] for r in get])
    if all("structured_tokens_per_s" in r for r in get):
        row("tokens/s, structured output", ".1f", [r["structured_tokens_per_s"] for r in get])
        ratios = [r["structured_tokens_per_s"] / r["on_tokens_per_s"] for r in get]
        row("structured / plain", ".2f", ratios)
    if all("matmul_only_ms" in r for r in get):
        row("full-batch decode, batch", "d", [r["full_decode_batch"] for r in get])
        row("  device step ms", ".2f", [r["full_decode_ms"] for r in get])
        row("  matmul-only ms", ".2f", [r["matmul_only_ms"] for r in get])
        row("  step / matmul-only", ".2f", [r["full_decode_ms"] / r["matmul_only_ms"] for r in get])
    if hf is not None:
        print(f"HF transformers generate_batch: {hf['tokens_per_s']:.1f} tokens/s")
    for peer in peers:
        print(f"{peer['name']} ({peer['detail']}): {peer['tokens_per_s']:.1f} tokens/s")
