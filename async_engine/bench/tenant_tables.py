"""What `bench serve --tenants` prints: each policy's per-tenant latency, goodput and
service, and the noisy-neighbour ratios between policies."""

from __future__ import annotations

import argparse
from typing import Any


def print_report(policy: str, out: dict[str, Any], weights: dict[str, float]) -> None:
    ms = 1000
    print(
        f"\n== policy {policy}: {out['output_tokens_per_s']:.0f} output tok/s, "
        f"{out['duration_s']:.1f} s"
    )
    print(
        f"{'tenant':>8} {'done':>9} | {'TTFT p50/p95/p99 ms':>22} | {'ITL p50/p95/p99 ms':>20} "
        f"| {'goodput':>7} | {'weighted service':>16} | {'last done s':>11}"
    )
    for name, t in out["tenants"].items():
        f, i = t["ttft_s"], t["itl_s"]
        print(
            f"{name:>8} {t['completed']:>4}/{t['requests']:<4} | "
            f"{f['p50'] * ms:>6.0f}/{f['p95'] * ms:>6.0f}/{f['p99'] * ms:>6.0f}   | "
            f"{i['p50'] * ms:>5.0f}/{i['p95'] * ms:>5.0f}/{i['p99'] * ms:>5.0f}   | "
            f"{t['goodput']:>7.2f} | {t['service']:>16.0f} | {t['last_done_s']:>11.1f}"
        )
    d = out["service_diff"]
    print(
        f"service difference among backlogged tenants: max {d['max']:.0f}, mean {d['mean']:.0f} "
        f"({d['samples']} samples)"
    )
    if out["weighted_service_ratio"] is not None:
        print(
            f"raw service ratio of the first two tenants while both backlogged: "
            f"{out['weighted_service_ratio']:.2f} (weights {weights or 'equal'})"
        )


def print_comparison(
    results: dict[str, Any], policies: list[str], args: argparse.Namespace
) -> None:
    """The noisy-neighbour figures: each policy's p95 TTFT of an --alone tenant over its
    p95 TTFT alone, and each policy's throughput over the first policy's."""
    base = results[policies[0]]["output_tokens_per_s"]
    for policy in policies[1:]:
        ratio = results[policy]["output_tokens_per_s"] / base
        print(f"throughput {policy} / {policies[0]}: {ratio:.3f}")
    for name in filter(None, (args.alone or "").split(",")):
        alone = results[f"{policies[0]} ({name} alone)"]["tenants"][name]["ttft_s"]["p95"]
        for policy in policies:
            shared = results[policy]["tenants"][name]["ttft_s"]["p95"]
            print(
                f"{name} p95 TTFT with {policy}: {1000 * shared:.0f} ms = "
                f"{shared / alone:.2f}x alone ({1000 * alone:.0f} ms)"
            )
