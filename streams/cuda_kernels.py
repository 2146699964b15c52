"""CUDA kernels from ``cuda/*.cu`` (compiled at run time by NVRTC through CuPy's RawModule),
each with a torch twin that does the same on any device.

The public functions run the kernel on a CUDA tensor when CuPy loads it and the twin
otherwise (a CPU tensor, or CuPy missing or failing: one log line says which and why). The
twins are also what a GPU test compares the kernels with. Import-safe everywhere: cupy is
imported only when a kernel is first asked for.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
THREADS = 256
STORE_KV_THREADS = 128
# cuda/kv_cache.cu's store_kv_<suffix> by cache dtype.
STORE_KV_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

log = logging.getLogger("streams.cuda_kernels")


@functools.cache
def _module(name: str) -> Any:
    import cupy

    source = (CUDA_DIR / f"{name}.cu").read_text()
    # NVRTC (CuPy's default backend) compiles at run time without a CUDA toolkit installed.
    return cupy.RawModule(code=source, options=("-std=c++17",))


def kernel_names() -> list[tuple[str, str]]:
    """(module, kernel) for every kernel that cuda/*.cu exports."""
    return [
        (path.stem, name)
        for path in sorted(CUDA_DIR.glob("*.cu"))
        for name in re.findall(r'extern "C" __global__ void (\w+)', path.read_text())
    ]


@functools.cache
def _kernel(module: str, name: str) -> Any | None:
    """The compiled kernel, or None (logged once) when it cannot be had."""
    try:
        return _module(module).get_function(name)
    except Exception as exc:  # ImportError, an NVRTC error, a driver error: all mean "twin"
        log.warning("cuda/%s.cu:%s unavailable, using its torch twin: %r", module, name, exc)
        return None


def _launch(module: str, name: str, blocks: int, threads: int, *args: Any) -> bool:
    """Run a kernel on torch's current stream; False when it cannot be had."""
    kernel = _kernel(module, name)
    if kernel is None:
        return False
    if blocks:
        import cupy

        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kernel((blocks,), (threads,), args)
    return True


def _on_gpu(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.is_contiguous() for t in tensors)


def fill_placeholders(
    input_ids: torch.Tensor, token_slots: torch.Tensor, token_buffer: torch.Tensor
) -> None:
    """In place: input_ids[i] = token_buffer[token_slots[i]] where input_ids[i] < 0 (int64)."""
    n = input_ids.numel()
    if _on_gpu(input_ids, token_slots, token_buffer) and _launch(
        "tokens",
        "fill_placeholders",
        -(-n // THREADS),
        THREADS,
        input_ids.data_ptr(),
        token_slots.data_ptr(),
        token_buffer.data_ptr(),
        np.int32(n),
    ):
        return
    fill_placeholders_twin(input_ids, token_slots, token_buffer)


def scatter_tokens(token_buffer: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: token_buffer[slots[i]] = tokens[i] (int64)."""
    n = slots.numel()
    if _on_gpu(token_buffer, slots, tokens) and _launch(
        "tokens",
        "scatter_tokens",
        -(-n // THREADS),
        THREADS,
        token_buffer.data_ptr(),
        slots.data_ptr(),
        tokens.data_ptr(),
        np.int32(n),
    ):
        return
    scatter_tokens_twin(token_buffer, slots, tokens)


def store_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; a slot < 0 (graph padding) stores nothing
) -> None:
    """Write this step's K/V at their slots of the paged cache."""
    if not try_store_kv(k_cache, v_cache, k, v, slot_mapping):
        store_kv_twin(k_cache, v_cache, k, v, slot_mapping)


def try_store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """``store_kv`` by the CUDA kernel; False (nothing written) where it cannot run, so the
    caller picks its own fallback (the model's, which a CUDA graph can capture)."""
    suffix = STORE_KV_SUFFIX.get(k_cache.dtype)
    return (
        suffix is not None
        and _on_gpu(k_cache, v_cache, k, v, slot_mapping)
        and _launch(
            "kv_cache",
            f"store_kv_{suffix}",
            slot_mapping.numel(),
            STORE_KV_THREADS,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            slot_mapping.data_ptr(),
            np.int32(k_cache.shape[2] * k_cache.shape[3]),
        )
    )


# --------------------------------------------------------------------------- twins
def fill_placeholders_twin(
    input_ids: torch.Tensor, token_slots: torch.Tensor, token_buffer: torch.Tensor
) -> None:
    input_ids.copy_(torch.where(input_ids < 0, token_buffer[token_slots], input_ids))


def scatter_tokens_twin(
    token_buffer: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor
) -> None:
    token_buffer[slots] = tokens


def store_kv_twin(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache.view(-1, cache.shape[2], cache.shape[3])[slots] = new[keep]
