"""The profile phase of ``make gpu-check``: ``async-engine profile --compare`` on the default
model's shape with dummy bfloat16 weights, overlap on and off, the step timeline taken from
CUDA events: device busy share, idle-gap percentiles and who each gap waited on.

One JSON record per mode with report.txt's figures and head, then compare.txt; exit 1 only
when the command fails or writes no report.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from async_engine.bench.gpu_models import SHAPES, emit, run_cli, write_model

STEPS = 300
REQUESTS = 64
HEAD_LINES = 25

_NUMBER = r"([\d.]+|n/a)"
_PATTERNS = {
    "throughput": re.compile(r"^throughput: (\d+) tokens in ([\d.]+) s = ([\d.]+) tok/s"),
    "busy": re.compile(rf"^device busy {_NUMBER}(?: %)?, idle {_NUMBER}"),
    "steady": re.compile(rf"^steady decode: idle {_NUMBER}(?: %)? over (\d+) step pairs"),
    "gaps": re.compile(rf"^  (all|steady decode)\s+(\d+)\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}$"),
    "blame": re.compile(r"^  ([a-z-]+)\s+([\d.]+)\s+([\d.]+) %\s+(\d+)$"),
}


def profile_argv(
    folder: Path,
    out: Path,
    device: str = "cuda",
    dtype: str = "bfloat16",
    steps: int = STEPS,
    requests: int = REQUESTS,
) -> list[str]:
    return [
        "profile",
        "--compare",
        "--model",
        str(folder),
        "--device",
        device,
        "--load-format",
        "dummy",
        "--dtype",
        dtype,
        "--steps",
        str(steps),
        "--requests",
        str(requests),
        "--max-num-seqs",
        str(requests),
        # Each request's prompt (16 tokens) and steps, in 16-token blocks, instead of 90 % of
        # the GPU: a start zeroes and maps only that.
        "--num-kv-blocks",
        str(requests * (-(-(16 + steps) // 16) + 1) + 16),
        "--out",
        str(out),
    ]


def _num(text: str) -> float | None:
    return None if text == "n/a" else float(text)


def _share(percent: str) -> float | None:
    value = _num(percent)
    return None if value is None else round(value / 100, 6)


def report_figures(text: str) -> dict[str, Any]:
    """report.txt's key figures (shares as fractions, gaps in ms), and its head."""
    figures: dict[str, Any] = {"gaps": {}, "blame_share": {}}
    for line in text.splitlines():
        if m := _PATTERNS["throughput"].match(line):
            figures["tokens"], figures["tokens_per_s"] = int(m[1]), float(m[3])
        elif m := _PATTERNS["busy"].match(line):
            figures["busy"], figures["idle"] = _share(m[1]), _share(m[2])
        elif m := _PATTERNS["steady"].match(line):
            figures["steady_decode_idle"], figures["steady_decode_pairs"] = _share(m[1]), int(m[2])
        elif m := _PATTERNS["gaps"].match(line):
            figures["gaps"][m[1]] = {
                "count": int(m[2]),
                "p50_ms": _num(m[3]),
                "p95_ms": _num(m[4]),
                "max_ms": _num(m[5]),
            }
        elif m := _PATTERNS["blame"].match(line):
            figures["blame_share"][m[1]] = _share(m[3])
    figures["head"] = "\n".join(text.splitlines()[:HEAD_LINES])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="smollm2-135m", choices=tuple(SHAPES))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as tmp:
        folder = write_model(Path(tmp) / args.shape, SHAPES[args.shape], weights=False)
        out = Path(tmp) / "out"
        status = run_cli(
            profile_argv(folder, out, args.device, args.dtype, args.steps, args.requests)
        )
        ok = status == 0
        for mode in ("on", "off"):
            report = out / mode / "report.txt"
            if not report.is_file():
                emit({"overlap": mode, "error": f"no report.txt (exit {status})"})
                ok = False
                continue
            emit({"overlap": mode, **report_figures(report.read_text())})
        compare = out / "compare.txt"
        if compare.is_file():
            emit({"compare": compare.read_text()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
