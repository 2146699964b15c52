"""`bench spec`'s tables: per workload and batch size, each method's tokens/s and ratio to
speculation off, inter-token latency, acceptance, accepted length and device idle; and how
far each method's greedy tokens agree with off's (exactly, in float32; in bf16 a verify
forward over several tokens may round differently from one token at a time)."""

from __future__ import annotations

from typing import Any


def agreement(per_method: dict[str, dict[int, dict]]) -> dict[str, dict[str, Any]]:
    """Per method: the share of token positions equal to off's, and the earliest index where
    a request's tokens first differ (None: none differ), over every batch size."""
    off = per_method["off"]
    out = {}
    for method, runs in per_method.items():
        if method == "off":
            continue
        same = total = 0
        first: int | None = None
        differences = []  # (prompt, index of the first token that differs)
        for batch, run in runs.items():
            pairs = zip(off[batch]["outputs"], run["outputs"], run["prompts"], strict=True)
            for want, got, prompt in pairs:
                n = min(len(want), len(got))
                diffs = [i for i in range(n) if want[i] != got[i]]
                total += n
                if diffs:
                    same += diffs[0]  # what follows a first difference is another text
                    first = diffs[0] if first is None else min(first, diffs[0])
                    differences.append((prompt, diffs[0]))
                else:
                    same += n
        out[method] = {
            "agreement": same / total if total else 1.0,
            "first_difference": first,
            "differences": differences,
        }
    return out


def round_spread(per_method: dict[str, dict[int, dict]]) -> str:
    """Per batch size and method, the lowest and highest of each round's ratio to off's
    round (empty with one round)."""
    off = per_method["off"]
    parts = []
    for batch, base in off.items():
        rounds = base.get("round_tokens_per_s", [])
        if len(rounds) < 2:
            continue
        cells = []
        for method, runs in per_method.items():
            if method == "off":
                continue
            ratios = [m / o for m, o in zip(runs[batch]["round_tokens_per_s"], rounds, strict=True)]
            cells.append(f"{method} {min(ratios):.2f}-{max(ratios):.2f}")
        parts.append(f"{batch}: " + ", ".join(cells))
    return "; ".join(parts)


def margin_summary(margins: list[float]) -> str:
    """The top-2 logprob margins where runs first differ: how close to a tie they were."""
    if not margins:
        return ""
    s = sorted(margins)
    return f"; top-2 margin there: median {s[len(s) // 2]:.3f}, max {s[-1]:.3f} nats"


def print_tables(
    results: dict[str, dict[str, dict[int, dict]]],
    float32: bool,
    margins: dict[str, dict[str, list[float]]] | None = None,
) -> None:
    """``margins``: per workload and method, the top-2 margins at each first difference."""
    for workload, per_method in results.items():
        methods = list(per_method)
        batches = list(per_method["off"])
        print(f"\n{workload} workload")
        header = f"{'batch':>6} " + "".join(f"{m:>30}" for m in methods)
        print(header)
        for batch in batches:
            off = per_method["off"][batch]["tokens_per_s"]
            cells = []
            for method in methods:
                run = per_method[method][batch]
                ratio = run["tokens_per_s"] / off if off else float("nan")
                cell = f"{run['tokens_per_s']:9.1f} tok/s"
                cell += "" if method == "off" else f" ({ratio:4.2f}x)"
                cells.append(f"{cell:>30}")
            print(f"{batch:>6} " + "".join(cells))
        spread = round_spread(per_method)
        if spread:
            print(f"{'':>6} each round's ratio to off, lowest-highest: {spread}")
        print(f"{'':>6} ITL p50/p95 ms, TPOT p50 ms, accepted share and length, device idle")
        for batch in batches:
            cells = []
            for method in methods:
                run = per_method[method][batch]
                itl, tpot = run["itl_ms"], run["tpot_ms"]
                cell = f"{itl['p50']:.1f}/{itl['p95']:.1f} {tpot['p50']:.1f}"
                if method != "off":
                    cell += f" {run['acceptance']:.2f} {run['accepted_length']:.2f}"
                cell += f" {100 * run['device_idle']:.1f}%"
                cells.append(f" {cell:>29}")
            print(f"{batch:>6} " + "".join(cells))
        for method, agree in agreement(per_method).items():
            first = agree["first_difference"]
            where = "identical" if first is None else f"first differs at token {first}"
            note = "" if float32 or first is None else " (bf16 rounding)"
            note += margin_summary(((margins or {}).get(workload) or {}).get(method, []))
            share = 100 * agree["agreement"]
            print(f"  {method}: greedy tokens agree with off on {share:.1f}%, {where}{note}")
