"""Compiling and loading the CPU kernels: one cached library per source, flags, ISA and CPU.

``ASYNC_ENGINE_CPU_ISA`` picks the instruction set: ``native`` (the default: everything this
CPU has, AVX512-BF16 and AMX included where present), ``noamx`` (native without AMX: the
kernels a CPU with AVX512-BF16 but no AMX runs, e.g. AMD Zen 4) or ``avx2``
(``-march=haswell``: AVX2, FMA and F16C, no AVX-512), which runs on this machine the kernels
an AMD EPYC without AVX-512 runs, so every path is tested and measured on one AMX machine.
Each ISA has its own cached library and all may be loaded in one process (the tests do):
they export only their entry points (``-fvisibility=hidden``), so none binds to another's
symbols.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("async_engine.model")
HERE = Path(__file__).resolve().parent
SOURCES = tuple(
    HERE / name
    for name in (
        "paged_decode.cpp",
        "paged_decode_vec.cpp",
        "paged_decode_amx.cpp",
        "paged_prefill.cpp",
        "paged_prefill_vec.cpp",
        "paged_prefill_amx.cpp",
        "elementwise.cpp",
    )
)
HEADERS = tuple(
    HERE / name for name in ("bf16.h", "vec.h", "kernels.h", "amx.h", "prefill_tiles.h")
)
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden")
ISA_ENV = "ASYNC_ENGINE_CPU_ISA"
ISA_FLAGS = {
    "native": ("-march=native",),
    "noamx": ("-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
    "avx2": ("-march=haswell",),
}


@functools.cache
def _warn_isa(value: str) -> None:
    log.warning("%s=%r is not one of %s: using native", ISA_ENV, value, ", ".join(ISA_FLAGS))


def selected_isa() -> str:
    """The ISA ``ASYNC_ENGINE_CPU_ISA`` names."""
    value = os.environ.get(ISA_ENV) or "native"
    if value not in ISA_FLAGS:
        _warn_isa(value)
        return "native"
    return value


def cache_dir() -> Path:
    root = os.environ.get("ASYNC_ENGINE_CACHE") or Path.home() / ".cache" / "async-engine"
    return Path(root) / "cpu-kernels"


def _cpu_key() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown-cpu"
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *ISA_FLAGS[isa])


def library_path(
    isa: str | None = None,
    *,
    name: str = "kernels",
    inputs: tuple[Path, ...] = (*SOURCES, *HEADERS),
    compile_flags: tuple[str, ...] | None = None,
) -> Path:
    """The cached library ``name`` for ``isa``, keyed by the ``inputs`` (sources and headers),
    ``compile_flags`` (default ``flags(isa)``) and the CPU: a change to any rebuilds it."""
    isa = isa or selected_isa()
    key = hashlib.sha256()
    parts = [p.read_bytes() for p in inputs]
    for part in (*parts, " ".join(compile_flags or flags(isa)).encode(), _cpu_key().encode()):
        key.update(part)
    return cache_dir() / f"{name}-{isa}-{key.hexdigest()[:16]}.so"


def build(
    target: Path,
    isa: str,
    *,
    sources: tuple[Path, ...] = SOURCES,
    compile_flags: tuple[str, ...] | None = None,
) -> None:
    """Compile ``sources`` with ``compile_flags`` (default ``flags(isa)``) into ``target``
    atomically (a parallel build never tears it)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *(compile_flags or flags(isa)), *map(str, sources), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    """The entry points' C signatures (see the extern "C" blocks of the sources)."""
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("paged_decode_supported", "paged_prefill_supported", "paged_spans_supported"):
        getattr(lib, name).restype = i32
        getattr(lib, name).argtypes = [i32, i32, i32]
    lib.paged_decode.restype = lib.paged_prefill.restype = lib.paged_spans.restype = None
    lib.paged_decode.argtypes = [i32, i32, *[ptr] * 4, i64, ptr, *[i32] * 5, f32, ptr]
    lib.paged_prefill.argtypes = [i32, i32, *[ptr] * 4, i64, *[ptr] * 3, *[i32] * 5, f32, ptr]
    lib.paged_spans.argtypes = lib.paged_prefill.argtypes
    for suffix in ("bf16", "f32"):
        norm, silu, rope = (
            getattr(lib, f"{op}_{suffix}") for op in ("rms_norm", "silu_mul", "rope")
        )
        norm.restype = silu.restype = rope.restype = None
        norm.argtypes = [ptr, i64, ptr, i64, i64, f32, ptr]
        silu.argtypes = [ptr, i64, i64, ptr]
        rope.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr]
    lib.kernel_isa.restype = lib.paged_decode_kernel.restype = ctypes.c_char_p
    lib.kernel_isa.argtypes = []
    lib.paged_decode_kernel.argtypes = [i32] * 6


@functools.cache
def load_isa(isa: str) -> ctypes.CDLL | None:
    """The kernels compiled for ``isa``, or None (logged once) where they cannot be built."""
    try:
        path = library_path(isa)
        if not path.exists():
            build(path, isa)
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels (%s) unavailable, using the torch path: %s", isa, exc)
        return None
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels for the selected ISA; None where off (``ASYNC_ENGINE_CPU_KERNELS=0``) or
    where they cannot be built or loaded. Cached: a test that switches ISA clears it."""
    if os.environ.get("ASYNC_ENGINE_CPU_KERNELS", "1") == "0":
        return None
    return load_isa(selected_isa())
