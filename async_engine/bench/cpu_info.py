"""The CPU a benchmark ran on, printed beside its figures: a CPU figure means little without
the model, the vector flags and which build of the CPU kernels ran."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The flags that decide which kernels and matmuls run fast (see cpu_kernels' docstring).
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_info(device: str = "cpu") -> dict[str, Any]:
    """Model name, core count, the relevant flags present, and the CPU kernels' ISA (None
    where they did not load, or for a device that runs no CPU kernels)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = None
    if device == "cpu":
        from async_engine.model import cpu_kernels

        isa = cpu_kernels.isa()
    return {
        "device": device,
        "model": model,
        "cores": os.cpu_count() or 1,
        "flags": [f for f in RELEVANT_FLAGS if f in flags],
        "kernel_isa": isa,
        "isa_setting": os.environ.get("ASYNC_ENGINE_CPU_ISA") or "native",
    }


def describe(info: dict[str, Any]) -> str:
    """One line: 'cpu: MODEL, N cores, flags ...; kernels: ISA (ASYNC_ENGINE_CPU_ISA=...)'."""
    kernels = info["kernel_isa"] or "none (torch path)"
    if info["device"] != "cpu":
        kernels = f"not used (device {info['device']})"
    return (
        f"cpu: {info['model']}, {info['cores']} cores, {' '.join(info['flags']) or 'no AVX2'}; "
        f"kernels: {kernels} (ASYNC_ENGINE_CPU_ISA={info['isa_setting']})"
    )
