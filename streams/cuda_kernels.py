"""CUDA kernels from ``cuda/*.cu``, compiled at run time by NVRTC through CuPy's RawModule.

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
    # NVRTC (CuPy's default backend) compiles at run time without a CUDA toolkit installed.
    return cupy.RawModule(code=source, options=("-std=c++17",))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _launch(kernel_name: str, n: int, *args: Any) -> None:
    """Run a kernel of tokens.cu over n items on torch's current stream."""
    import cupy

    if n == 0:
        return
    kernel = _module("tokens").get_function(kernel_name)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    with stream:
        kernel(((n + THREADS - 1) // THREADS,), (THREADS,), (*args, cupy.int32(n)))


def fill_placeholders(
    input_ids: torch.Tensor, token_slots: torch.Tensor, token_buffer: torch.Tensor
) -> None:
    """In place: input_ids[i] = token_buffer[token_slots[i]] where input_ids[i] < 0."""
    _launch("fill_placeholders", input_ids.numel(), _ptr(input_ids), _ptr(token_slots),
            _ptr(token_buffer))  # fmt: skip


def scatter_tokens(token_buffer: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: token_buffer[slots[i]] = tokens[i]."""
    _launch("scatter_tokens", slots.numel(), _ptr(token_buffer), _ptr(slots), _ptr(tokens))
