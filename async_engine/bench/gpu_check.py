"""``make gpu-check``: what only a GPU can show, in phases with their own time limits, each
appending to one JSON report, so a run that is killed still returns what it measured.

Run on the GPU host from the repository root with the system Python (no package index
there): ``python3 -m async_engine.bench.gpu_check --out gpu-check.json``. Exit status 1 on
any mismatch, failed phase or time-out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

# name -> (command, seconds allowed). Under 8 minutes in all.
PYTEST_CUDA = ["-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_cuda.py"]
PHASES: dict[str, tuple[list[str], int]] = {
    "kernels": ([sys.executable, "-m", "async_engine.bench.gpu_kernels"], 180),
    "pytest-cuda": ([sys.executable, *PYTEST_CUDA], 240),
}
# What each phase imports beyond the standard library: a host without them gets the phase
# reported as missing them (a failure), not a traceback.
NEEDS = {
    "kernels": ["torch", "triton", "numpy", "cupy"],
    "pytest-cuda": ["torch", "cupy", "pytest", "pytest_asyncio", "hypothesis", "transformers"],
}


def run_phase(name: str, command: list[str], limit: int, report: Path) -> bool:
    started = time.monotonic()
    missing = [m for m in NEEDS.get(name, []) if importlib.util.find_spec(m) is None]
    try:
        if missing:
            raise ModuleNotFoundError(", ".join(missing))
        proc = subprocess.run(command, capture_output=True, text=True, timeout=limit)
        status, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        status, out, err = "timeout", _text(exc.stdout), _text(exc.stderr)
    except ModuleNotFoundError as exc:
        status, out, err = f"missing modules: {exc}", "", ""
    records = []
    for line in out.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    entry = {"phase": name, "status": status, "seconds": round(time.monotonic() - started, 1),
             "records": records, "output_tail": (out + err)[-4000:]}  # fmt: skip
    with report.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    print(f"{name}: {status} in {entry['seconds']} s", flush=True)
    return status == 0


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"),
                        help="JSON lines report, one line per phase")  # fmt: skip
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    args = parser.parse_args(argv)
    names = [n for n in args.phases.split(",") if n]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; known: {', '.join(PHASES)}")
    args.out.write_text("")
    ok = True
    for name in names:
        command, limit = PHASES[name]
        ok &= run_phase(name, command, limit, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
