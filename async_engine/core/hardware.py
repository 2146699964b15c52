"""What this machine offers the engine's defaults: a GPU, or a CPU with fast bfloat16."""

from __future__ import annotations

import os


def default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "cpu"


def cpu_has_fast_bf16() -> bool:
    """bfloat16 matmuls are fast where the CPU has AVX512-BF16 or AMX; float32 elsewhere.

    ``ASYNC_ENGINE_CPU_ISA=avx2`` answers as an AVX2 CPU would, so that one machine runs
    what those CPUs run by default (with ``ONEDNN_MAX_CPU_ISA=AVX2`` for the matmuls)."""
    if os.environ.get("ASYNC_ENGINE_CPU_ISA") == "avx2":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
