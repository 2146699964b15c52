"""CUDA kernels from ``cuda/*.cu``, compiled at run time with CuPy RawModule.

Import-safe everywhere: cupy is imported only when a kernel is first asked for.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
THREADS = 256


@functools.cache
def _module(name: str) -> Any:
    import cupy

    source = (CUDA_DIR / f"{name}.cu").read_text()
    return cupy.RawModule(code=source, backend="nvcc", options=("-std=c++17",))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def fill_placeholders(
    input_ids: torch.Tensor, token_slots: torch.Tensor, token_buffer: torch.Tensor
) -> None:
    """In place on the current stream: input_ids[i] = token_buffer[token_slots[i]] where < 0."""
    import cupy

    n = input_ids.numel()
    if n == 0:
        return
    kernel = _module("tokens").get_function("fill_placeholders")
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        kernel(((n + THREADS - 1) // THREADS,), (THREADS,),
               (_ptr(input_ids), _ptr(token_slots), _ptr(token_buffer), cupy.int32(n)))  # fmt: skip


def scatter_tokens(token_buffer: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place on the current stream: token_buffer[slots[i]] = tokens[i]."""
    import cupy

    n = slots.numel()
    if n == 0:
        return
    kernel = _module("tokens").get_function("scatter_tokens")
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        kernel(((n + THREADS - 1) // THREADS,), (THREADS,),
               (_ptr(token_buffer), _ptr(slots), _ptr(tokens), cupy.int32(n)))  # fmt: skip
