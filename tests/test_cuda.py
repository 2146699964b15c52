"""CUDA: every kernel compiles with nvcc (runs on CPU machines too); GPU checks need a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
KERNELS = sorted(CUDA_DIR.glob("*.cu"))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", KERNELS, ids=[k.name for k in KERNELS])
def test_kernel_compiles_with_nvcc(source: Path, tmp_path: Path):
    out = tmp_path / (source.stem + ".cubin")
    proc = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 0


def test_cuda_modules_import_without_a_gpu():
    import streams.cuda_kernels  # noqa: F401
    import streams.process_device  # noqa: F401


@pytest.mark.cuda
@needs_gpu
def test_fill_placeholders_kernel_matches_torch():
    pytest.importorskip("cupy")
    from streams import cuda_kernels

    ids = torch.tensor([5, -1, 7, -1], device="cuda")
    slots = torch.tensor([0, 1, 2, 3], device="cuda")
    buffer = torch.tensor([10, 11, 12, 13], device="cuda")
    cuda_kernels.fill_placeholders(ids, slots, buffer)
    assert ids.tolist() == [5, 11, 7, 13]


@pytest.mark.cuda
@needs_gpu
def test_cuda_engine_greedy_equals_cpu_engine(tiny_model: Path):
    from async_engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(100, 180))]
    outs = {}
    for device in ("cpu", "cuda"):
        with LLM(str(tiny_model), dtype="float32", device=device) as llm:
            outs[device] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["cuda"] == outs["cpu"]
