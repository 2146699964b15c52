"""C++ kernels for the CPU device, compiled once per machine with the system's C++ compiler.

The sources ship with the package; the first use compiles them with ``-O3 -march=native
-fopenmp`` (a few seconds) into the cache folder, keyed by the source, the flags and
the CPU, and later processes load the cached library. The library links the OpenMP runtime
torch already loaded, so ``torch.set_num_threads`` governs its threads too. ctypes drops the
GIL for the call. Where no compiler is found or the build fails, ``load()`` returns None
once, with the reason logged, and callers keep their torch path.
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

import torch

log = logging.getLogger("async_engine.model")
HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_decode.cpp", HERE / "paged_prefill.cpp", HERE / "elementwise.cpp")
HEADERS = (HERE / "bf16.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


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


def library_path() -> Path:
    key = hashlib.sha256()
    parts = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(FLAGS).encode(), _cpu_key().encode()):
        key.update(part)
    return cache_dir() / f"attention-{key.hexdigest()[:16]}.so"


def build(target: Path) -> None:
    """Compile the source into ``target`` atomically (a parallel build never tears it)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp],
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


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) where they cannot be built or loaded."""
    if os.environ.get("ASYNC_ENGINE_CPU_KERNELS", "1") == "0":
        return None
    try:
        path = library_path()
        if not path.exists():
            build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU attention kernel unavailable, using the torch path: %s", exc)
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ptr] * 4 + [i64, ptr] + [i32] * 5 + [ctypes.c_float, ptr]
    lib.paged_prefill_bf16.restype = None
    lib.paged_prefill_bf16.argtypes = (
        [ptr] * 4 + [i64] + [ptr] * 3 + [i32] * 5 + [ctypes.c_float, ptr]
    )
    lib.paged_prefill_supported.restype = i32
    lib.paged_prefill_supported.argtypes = [i32]
    lib.rms_norm_bf16.restype = lib.silu_mul_bf16.restype = lib.rope_bf16.restype = None
    lib.rms_norm_bf16.argtypes = [ptr, i64, ptr, i64, i64, ctypes.c_float, ptr]
    lib.silu_mul_bf16.argtypes = [ptr, i64, i64, ptr]
    lib.rope_bf16.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr]
    return lib


KERNEL_DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def available() -> bool:
    return load() is not None


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context; returns [B, H, D]."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available")
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("q and the KV cache must share a dtype, heads a multiple of KV heads")
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    if lens.numel() != batch or tables.shape[0] != batch:  # values: see AttentionPlan.build
        raise ValueError(f"{batch} queries need {batch} block-table rows and context lengths")
    out = torch.empty_like(q)
    getattr(lib, KERNEL_DTYPES[q.dtype])(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        batch,
        heads,
        kv_heads,
        head_dim,
        block_size,
        head_dim**-0.5,
        out.data_ptr(),
    )
    return out


def prefill_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``paged_prefill`` runs here: bf16, head_dim 64 or 128, a CPU with AVX512-BF16."""
    lib = load()
    return (
        dtype == torch.bfloat16 and lib is not None and bool(lib.paged_prefill_supported(head_dim))
    )


def paged_prefill(
    q: torch.Tensor,  # [T, H, D] bf16: the step's packed query tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], this step's K already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64, one row per prefill sequence
    q_starts: torch.Tensor,  # [S] int64: row in q of each sequence's first query token
    q_lens: torch.Tensor,  # [S] int64
    context_lens: torch.Tensor,  # [S] int64: tokens in the cache after this step
    out: torch.Tensor,  # [T, H, D] bf16: the sequences' rows are written, others untouched
) -> None:
    """Causal attention of each sequence's query tokens over its paged context."""
    lib = load()
    _, heads, head_dim = q.shape
    if lib is None or not prefill_supported(q.dtype, head_dim):
        raise RuntimeError("the CPU prefill kernel does not run here")
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads or k_cache.dtype != q.dtype or out.shape != q.shape:
        raise ValueError("q, out and the KV cache must agree in dtype and shape")
    if not (q.is_contiguous() and out.is_contiguous() and block_tables.is_contiguous()):
        raise ValueError("q, out and block_tables must be contiguous")
    num_seqs = q_lens.numel()
    if not block_tables.shape[0] == q_starts.numel() == context_lens.numel() == num_seqs:
        raise ValueError(f"{num_seqs} sequences need as many table rows, starts and lengths")
    lib.paged_prefill_bf16(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        context_lens.data_ptr(),
        num_seqs,
        heads,
        kv_heads,
        head_dim,
        block_size,
        head_dim**-0.5,
        out.data_ptr(),
    )


def elementwise_apply(x: torch.Tensor) -> bool:
    """Whether the fused bf16 elementwise kernels below take ``x`` (else: the torch ops)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and load() is not None


def _rows(x: torch.Tensor) -> int:
    """Elements between rows of a 2-D view whose rows are contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("expected a 2-D tensor with contiguous rows")
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[N, H] bf16 -> x / rms(x) * weight, float32 inside, rounded once."""
    lib = load()
    out = x.new_empty(x.shape[0], x.shape[1])
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}] tensor")
    lib.rms_norm_bf16(
        x.data_ptr(), _rows(x), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr()
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] bf16 (gate | up) -> silu(gate) * up, [N, I]."""
    lib = load()
    if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError("gate_up must be contiguous with an even width")
    inter = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], inter)
    lib.silu_mul_bf16(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (token rows may be strided, heads contiguous) with cos and sign-folded
    sin [T, D] -> rotate-half RoPE, a new contiguous [T, heads, D]."""
    lib = load()
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError("each token's heads must be contiguous")
    if cos.shape != (tokens, dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{tokens}, {dim}]")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = x.new_empty(tokens, heads, dim)
    lib.rope_bf16(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        heads,
        dim,
        out.data_ptr(),
    )
    return out
