"""C++ kernels for the CPU device, compiled once per machine with the system's C++ compiler.

The sources ship with the package; the first use compiles them with ``-O3 -march=native
-fopenmp`` (a few seconds; ``ASYNC_ENGINE_CPU_ISA=avx2`` builds the AVX2 path instead, see
``build``) into the cache folder, keyed by the source, the flags and the CPU, and later
processes load the cached library. The library links the OpenMP runtime torch already
loaded, so ``torch.set_num_threads`` governs its threads too. ctypes drops the GIL for the
call. Where no compiler is found or the build fails, ``load()`` returns None once, with the
reason logged, and callers keep their torch path.

What runs where (head_dim a multiple of the vector width for the vector kernels):

- AMX-BF16 (with AVX512-BF16): bf16 attention on the tile unit, for head_dim 64 or 128
  (decode also needs blocks of a multiple of 16 positions and groups of at most 16 heads);
- AVX512-BF16: bf16 attention in bf16 dot products; float32 attention (and a bf16 or fp16
  cache under float32 queries) in 16-lane float32 vectors;
- AVX2+FMA (or AVX-512 without BF16): every attention in 8- (16-) lane float32 vectors,
  bf16 and fp16 operands widened in registers;
- elsewhere: generic decode loops for float32 and bf16, no prefill kernel (torch SDPA).
- fused RMSNorm, RoPE and SiLU-and-multiply for float32 and bf16 on every build.

The float32 vector decode kernel splits each context into parts of 512 positions (merged at
the end), so a batch of one spreads over the threads; it also takes rows of several tokens
(``paged_spans``: a verify step's rows), every K/V row read once for all of them, each token
attended exactly as decoding it alone would be.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .build import library_path, load, load_isa, selected_isa

__all__ = ["library_path", "load", "load_isa", "selected_isa"]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kernels.h DType
ELEMENTWISE = {torch.float32: "f32", torch.bfloat16: "bf16"}


def available() -> bool:
    return load() is not None


def isa() -> str | None:
    """The instruction set the loaded kernels were built for (avx512-bf16, avx512, avx2,
    generic), or None where none loaded."""
    lib = load()
    return None if lib is None else lib.kernel_isa().decode()


def _codes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[int, int] | None:
    if q_dtype not in DTYPE_CODES or kv_dtype not in DTYPE_CODES:
        return None
    return DTYPE_CODES[q_dtype], DTYPE_CODES[kv_dtype]


def decode_supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``paged_decode`` takes queries of ``q_dtype`` over a cache of ``kv_dtype``."""
    lib, codes = load(), _codes(q_dtype, kv_dtype)
    if not available() or lib is None or codes is None:  # available(): what tests switch off
        return False
    return bool(lib.paged_decode_supported(*codes, head_dim))


def decode_kernel(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> str | None:
    """Which kernel ``paged_decode`` runs for this shape: "amx", "avx512-bf16", "vector" or
    "generic"; None where none does."""
    lib, codes = load(), _codes(q_dtype, kv_dtype)
    if not available() or lib is None or codes is None:
        return None
    name = lib.paged_decode_kernel(*codes, heads, kv_heads, head_dim, block_size).decode()
    return None if name == "none" else name


def prefill_supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``paged_prefill`` runs here for these dtypes and head size."""
    lib, codes = load(), _codes(q_dtype, kv_dtype)
    if not available() or lib is None or codes is None:
        return False
    return bool(lib.paged_prefill_supported(*codes, head_dim))


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if heads % kv_heads or v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        raise ValueError("K and V caches must match, and heads be a multiple of KV heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")


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
    _check_cache(q, k_cache, v_cache)
    if not decode_supported(q.dtype, k_cache.dtype, head_dim):
        raise ValueError(f"no decode kernel for these dtypes: {q.dtype} q, {k_cache.dtype} cache")
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    if lens.numel() != batch or tables.shape[0] != batch:  # values: see AttentionPlan.build
        raise ValueError(f"{batch} queries need {batch} block-table rows and context lengths")
    out = torch.empty_like(q)
    lib.paged_decode(
        *_codes(q.dtype, k_cache.dtype),
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


def paged_prefill(
    q: torch.Tensor,  # [T, H, D]: the step's packed query tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], this step's K already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64, one row per prefill sequence
    q_starts: torch.Tensor,  # [S] int64: row in q of each sequence's first query token
    q_lens: torch.Tensor,  # [S] int64
    context_lens: torch.Tensor,  # [S] int64: tokens in the cache after this step
    out: torch.Tensor,  # [T, H, D] in q's dtype: the sequences' rows are written, others untouched
) -> None:
    """Causal attention of each sequence's query tokens over its paged context."""
    lib = load()
    if lib is None or not prefill_supported(q.dtype, k_cache.dtype, q.shape[2]):
        raise RuntimeError("the CPU prefill kernel does not run here")
    _call_chunks(lib.paged_prefill, q, k_cache, v_cache, block_tables, q_starts, q_lens,
                 context_lens, out)  # fmt: skip


def _call_chunks(
    entry: Callable[..., None],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """A kernel taking packed chunks (paged_prefill's arguments), its arguments checked."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    _check_cache(q, k_cache, v_cache)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("out must match q in dtype and shape")
    if not (q.is_contiguous() and out.is_contiguous() and block_tables.is_contiguous()):
        raise ValueError("q, out and block_tables must be contiguous")
    num_seqs = q_lens.numel()
    if not block_tables.shape[0] == q_starts.numel() == context_lens.numel() == num_seqs:
        raise ValueError(f"{num_seqs} sequences need as many table rows, starts and lengths")
    entry(
        *_codes(q.dtype, k_cache.dtype),
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


def spans_supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``paged_spans`` runs here for these dtypes and head size."""
    lib, codes = load(), _codes(q_dtype, kv_dtype)
    if not available() or lib is None or codes is None:
        return False
    return bool(lib.paged_spans_supported(*codes, head_dim))


def paged_spans(
    q: torch.Tensor,  # [T, H, D]: the step's packed query tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], this step's K already written
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64, one row per sequence
    q_starts: torch.Tensor,  # [S] int64: row in q of each sequence's first query token
    q_lens: torch.Tensor,  # [S] int64
    context_lens: torch.Tensor,  # [S] int64: tokens in the cache after this step
    out: torch.Tensor,  # [T, H, D] in q's dtype: the sequences' rows are written, others untouched
) -> None:
    """Causal attention of sequences whose every query token is sampled (decode and verify
    rows), each token exactly as the decode kernel attends it alone."""
    lib = load()
    if lib is None or not spans_supported(q.dtype, k_cache.dtype, q.shape[2]):
        raise RuntimeError("the CPU spans kernel does not run here")
    _call_chunks(lib.paged_spans, q, k_cache, v_cache, block_tables, q_starts, q_lens,
                 context_lens, out)  # fmt: skip


def elementwise_apply(x: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels below take ``x`` (else: the torch ops)."""
    return x.dtype in ELEMENTWISE and x.device.type == "cpu" and available()


def _entry(name: str, x: torch.Tensor) -> Callable[..., None]:
    lib = load()
    if lib is None or x.dtype not in ELEMENTWISE:
        raise RuntimeError(f"no fused {name} for {x.dtype} here")
    return getattr(lib, f"{name}_{ELEMENTWISE[x.dtype]}")


def _rows(x: torch.Tensor) -> int:
    """Elements between rows of a 2-D view whose rows are contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("expected a 2-D tensor with contiguous rows")
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[N, H] -> x / rms(x) * weight, float32 inside, rounded once (bf16)."""
    fn = _entry("rms_norm", x)
    if weight.shape != (x.shape[1],) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}] tensor of x's dtype")
    out = x.new_empty(x.shape[0], x.shape[1])
    fn(x.data_ptr(), _rows(x), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up, [N, I]."""
    fn = _entry("silu_mul", gate_up)
    if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError("gate_up must be contiguous with an even width")
    inter = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], inter)
    fn(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (token rows may be strided, heads contiguous) with cos and sign-folded
    sin [T, D] -> rotate-half RoPE, a new contiguous [T, heads, D]."""
    fn = _entry("rope", x)
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError("each token's heads must be contiguous")
    if cos.shape != (tokens, dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{tokens}, {dim}]")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError("cos and sin must be in x's dtype")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = x.new_empty(tokens, heads, dim)
    fn(
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
