"""The bench phase of ``make gpu-check``: ``async-engine bench offline`` on the default model's
shape with dummy bfloat16 weights, at batch 64 and 256, CUDA graphs on and off (each run
measures overlap on and off): tokens/s, device busy fractions, the overlap and graphs ratios.

Targets are reported as booleans, never failed on: a slow GPU is not a wrong one. One JSON
record per line; ``bench offline``'s own table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from async_engine.bench.gpu_models import SHAPES, emit, run_cli, write_model

BATCHES = (64, 256)
MAX_TOKENS = 128
BUSY_TARGET = 0.95  # steady decode at batch 64, overlap on
OVERLAP_TARGET = 1.2  # tokens/s overlap on / off
GRAPHS_TARGET = 1.5  # tokens/s graphs on / off, overlap on
MAX_PROMPT = 300  # tokens, the longest prompt of a run


def offline_argv(
    folder: Path,
    batch: int,
    graphs: bool,
    out: Path,
    device: str = "cuda",
    dtype: str = "bfloat16",
    max_tokens: int = MAX_TOKENS,
) -> list[str]:
    """``batch`` requests, all admitted at once (max_num_seqs = batch)."""
    return [
        "bench",
        "offline",
        "--model",
        str(folder),
        "--device",
        device,
        "--load-format",
        "dummy",
        "--dtype",
        dtype,
        "--requests",
        str(batch),
        "--max-num-seqs",
        str(batch),
        "--num-kv-blocks",
        # The KV pool the run needs (each request's longest prompt and its tokens, in
        # 16-token blocks), not 90 % of the GPU: a start zeroes and maps only that.
        str(batch * (-(-(MAX_PROMPT + max_tokens) // 16) + 1) + 16),
        "--max-prompt",
        str(MAX_PROMPT),
        "--max-tokens",
        str(max_tokens),
        "--rounds",
        "1",
        "--skip-hf",
        "--cuda-graphs",
        "on" if graphs else "off",
        "--json",
        str(out),
    ]


def run_figures(report: dict[str, Any], batch: int, graphs: bool) -> dict[str, Any]:
    """One record from ``bench offline --json``: its single device column's figures."""
    # A CPU run may add a column with every core; the first is the configured device.
    figures = next(iter(report["engine"].values()))
    on, off = figures["on_tokens_per_s"], figures["off_tokens_per_s"]
    return {
        "batch": batch,
        "cuda_graphs": graphs,
        "on_tokens_per_s": on,
        "off_tokens_per_s": off,
        "overlap_ratio": on / off,
        "roofline_tokens_per_s": figures["roofline_tokens_per_s"],
        "busy_on": 1.0 - figures["on_idle"],
        "busy_off": 1.0 - figures["off_idle"],
        "steady_decode_busy_on": 1.0 - figures["on_steady_decode_idle"],
        "steady_decode_busy_off": 1.0 - figures["off_steady_decode_idle"],
        "ms_per_step_on": figures["on_ms_per_step"],
        "ms_per_step_off": figures["off_ms_per_step"],
        "full_decode_batch": figures["full_decode_batch"],
        "full_decode_ms": figures["full_decode_ms"],
        "matmul_only_ms": figures.get("matmul_only_ms"),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios per batch and the targets, from whichever runs completed."""
    by = {(r["batch"], r["cuda_graphs"]): r for r in runs}
    overlap = {b: r["overlap_ratio"] for (b, graphs), r in by.items() if graphs}
    graphs_ratio = {
        b: by[b, True]["on_tokens_per_s"] / by[b, False]["on_tokens_per_s"]
        for b, g in by
        if g and (b, False) in by
    }
    at = min((b for b, _ in by), default=min(BATCHES))
    busy = by[at, True]["steady_decode_busy_on"] if (at, True) in by else None
    return {
        "summary": True,
        "overlap_ratio": {str(b): v for b, v in sorted(overlap.items())},
        "graphs_ratio": {str(b): v for b, v in sorted(graphs_ratio.items())},
        "targets": {
            f"steady_decode_busy_at_{at}_ge_{BUSY_TARGET}": _met(busy, BUSY_TARGET),
            f"overlap_ratio_at_{at}_ge_{OVERLAP_TARGET}": _met(overlap.get(at), OVERLAP_TARGET),
            f"graphs_ratio_at_{at}_ge_{GRAPHS_TARGET}": _met(graphs_ratio.get(at), GRAPHS_TARGET),
        },
    }


def _met(value: float | None, target: float) -> bool | None:
    """None: not measured (a run failed or the phase ran out of time)."""
    return None if value is None else value >= target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="smollm2-135m", choices=tuple(SHAPES))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    code = 0
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        folder = write_model(Path(tmp) / args.shape, SHAPES[args.shape], weights=False)
        for batch in (int(b) for b in args.batches.split(",") if b):
            for graphs in (True, False):
                out = Path(tmp) / f"bench-{batch}-{graphs}.json"
                argv_ = offline_argv(
                    folder, batch, graphs, out, args.device, args.dtype, args.max_tokens
                )
                try:  # one broken configuration must not cost the others' figures
                    status: int | str = run_cli(argv_)
                except Exception as exc:
                    status = repr(exc)
                if status != 0 or not out.is_file():
                    emit({"batch": batch, "cuda_graphs": graphs, "error": f"exit {status}"})
                    code = 1
                    continue
                runs.append(run_figures(json.loads(out.read_text()), batch, graphs))
                emit(runs[-1])
    emit(summary(runs))
    return code


if __name__ == "__main__":
    sys.exit(main())
