"""Engine settings. Every limit a user can set lives here, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass


def default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "cpu"


def cpu_has_fast_bf16() -> bool:
    """bfloat16 matmuls are fast where the CPU has AVX512-BF16 or AMX; float32 elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    overlap: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from max_num_seqs and max_model_len
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's context length
    max_waiting: int = 4096  # queue limit; past it, submissions are refused
    enable_prefix_cache: bool = True
    device_threads: int | None = None  # CPU device: torch threads (None: cores minus one)
    seed: int = 0
    fail_on_token_id: int | None = None  # fault injection for tests: a step with it fails

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def resolved_device(self) -> str:
        return default_device() if self.device == "auto" else self.device

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device() == "cuda":
            return "bfloat16"
        return "bfloat16" if cpu_has_fast_bf16() else "float32"

    def resolved_device_threads(self) -> int:
        if self.device_threads is not None:
            return max(1, self.device_threads)
        return max(1, (os.cpu_count() or 2) - 1)
