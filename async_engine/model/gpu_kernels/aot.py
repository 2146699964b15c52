"""Ahead-of-time compile of the attention kernels for an H200 (sm_90a), with no GPU or driver.

Used by tests on CPU hosts to catch what the interpreter accepts but the compiler rejects
(``tl.dot`` with K < 16, unsupported ops), to check the half-precision dots reach tensor cores,
and to read register use and spills from the cubin. Importing this module imports triton. It
cannot compile in a process that imported triton with ``TRITON_INTERPRET`` set (triton.language's
own helpers, ``tl.zeros`` and the like, are then interpreted and patch the language as they
run), so tests run ``python -m async_engine.model.gpu_kernels.aot``, which prints one JSON line per
specialization.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from . import paged_attention as pa
from . import paged_attention_kernels as kernels

SM90 = GPUTarget("cuda", 90, 32)  # arch 90 compiles to sm_90a; 32 threads per warp
TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Strides fit int32; the kernels widen to int64 where a product could overflow.
_STRIDES = (
    "q_stride_t",
    "q_stride_h",
    "o_stride_t",
    "o_stride_h",
    "c_stride_b",
    "c_stride_s",
    "c_stride_h",
    "table_stride",
)


def compile_for_sm90(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    *,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Any:
    """Compile one specialization of a ``@triton.jit`` kernel for sm_90a; returns triton's
    CompiledKernel, whose ``asm`` holds "ptx", "cubin" (bytes) and the IRs, and ``metadata``
    the shared memory. Takes a kernel decorated under the interpreter too, but cannot run in a
    process that imported triton with ``TRITON_INTERPRET`` set."""
    if not isinstance(triton.language.zeros, JITFunction):
        raise RuntimeError(
            "triton was imported with TRITON_INTERPRET set; compile in a separate process"
        )
    fn = _compilable(kernel)
    missing = set(fn.arg_names) - set(signature)
    if missing:
        raise ValueError(f"signature lacks {sorted(missing)}")
    for name in constexprs:
        if signature.get(name) != "constexpr":
            raise ValueError(f"{name} has a value but is not 'constexpr' in the signature")
    src = ASTSource(fn, signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=SM90, options=options)


def launch_keys(kernel: Any) -> Callable[..., tuple]:
    """A function of a launch's arguments giving the key triton's launcher compiles a variant
    for on an H200: each argument's type and specialised attribute (a pointer's 16-byte
    alignment, an int's divisibility by 16 or being 1, unless ``do_not_specialize``), the
    constexprs and the launch options. Launches with equal keys share one compiled kernel;
    works on CPU tensors and interpreted kernels, with no driver."""
    fn = _compilable(kernel)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(SM90))

    def key(*args: Any, **kwargs: Any) -> tuple:
        _, specialization, options = binder(*args, **kwargs)
        return (*specialization, *sorted(options.items()))

    return key


def _compilable(kernel: Any) -> JITFunction:
    fn = kernel if isinstance(kernel, JITFunction) else getattr(kernel, "fn", None)
    if fn is None or not callable(fn):
        raise TypeError(f"{kernel!r} is not a triton kernel")
    if isinstance(fn, JITFunction):
        return fn
    # An InterpretedFunction: rebuild the compilable form from the same Python source, with
    # the decorator's options (do_not_specialize).
    return JITFunction(fn, **getattr(kernel, "kwargs", {}))


def _signature(dtype: torch.dtype, int_pointers: tuple[str, ...]) -> dict[str, str]:
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    sig = {n: f"*{TRITON_DTYPES[dtype]}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    sig.update(dict.fromkeys(int_pointers, "*i64"))
    sig.update(dict.fromkeys(_STRIDES, "i32"))
    sig["qk_scale"] = "fp32"
    return sig


def compile_decode(dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> Any:
    """The decode kernel as ``paged_decode`` launches it (int64 block tables and lengths)."""
    consts = {
        "GROUP": group,
        "GROUP_PAD": max(kernels.MIN_DOT, pa._pow2(group)),
        "HEAD_DIM": head_dim,
        "DIM_PAD": pa._pow2(head_dim),
        "BLOCK_SIZE": block_size,
        "DOT_F32": False,
        "PRECISION": "ieee",
    }
    sig = _signature(dtype, ("tables_ptr", "lens_ptr"))
    sig.update(dict.fromkeys(consts, "constexpr"))
    return compile_for_sm90(kernels.paged_decode_kernel, sig, consts, num_warps=pa.DECODE_WARPS)


def compile_varlen(dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> Any:
    """The unified prefill/chunk/decode kernel as ``paged_varlen`` launches it by default."""
    block_m, num_warps = pa.varlen_config(dtype, head_dim)
    consts = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "DIM_PAD": pa._pow2(head_dim),
        "BLOCK_SIZE": block_size,
        "BLOCK_M": block_m,
        "DOT_F32": False,
        "PRECISION": "ieee",
    }
    sig = _signature(dtype, ("tables_ptr", "starts_ptr", "q_lens_ptr", "lens_ptr"))
    sig.update(dict.fromkeys(consts, "constexpr"))
    return compile_for_sm90(kernels.paged_varlen_kernel, sig, consts, num_warps=num_warps)


def resource_usage(compiled: Any) -> dict[str, int]:
    """Registers and stack bytes per thread (stack > 0: spills), read from the cubin with the
    cuobjdump triton ships; no GPU needed."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        proc = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    found = re.search(r"REG:(\d+) STACK:(\d+)", proc.stdout)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump output: {proc.stdout[-500:]}")
    return {"registers": int(found[1]), "stack": int(found[2])}


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> None:
    """Compile each kernel for every dtype x head_dim x block size asked; one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=sorted(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[16, 32])
    parser.add_argument("--group", type=int, default=3)
    args = parser.parse_args(argv)
    for name, build in (("decode", compile_decode), ("varlen", compile_varlen)):
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                for block_size in args.block_sizes:
                    start = time.perf_counter()
                    kernel = build(DTYPES[dtype], head_dim, block_size, args.group)
                    seconds = time.perf_counter() - start
                    ptx = kernel.asm["ptx"]
                    print(
                        json.dumps(
                            {
                                "kernel": name,
                                "dtype": dtype,
                                "head_dim": head_dim,
                                "block_size": block_size,
                                "seconds": seconds,
                                "cubin_bytes": len(kernel.asm["cubin"]),
                                "sm_90a": ".target sm_90a" in ptx,
                                "mma": "mma" in ptx,
                                "wgmma": "wgmma" in ptx,
                                "shared": kernel.metadata.shared,
                                **resource_usage(kernel),
                            }
                        ),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
