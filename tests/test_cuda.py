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


def _nvcc(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@needs_nvcc
@pytest.mark.parametrize("source", KERNELS, ids=[k.name for k in KERNELS])
def test_kernel_compiles_with_nvcc(source: Path, tmp_path: Path):
    out = tmp_path / (source.stem + ".cubin")
    proc = _nvcc(source, out)
    assert proc.returncode == 0, proc.stderr  # nvcc's message names the file and line
    assert out.stat().st_size > 0


@needs_nvcc
def test_a_broken_kernel_is_reported_with_its_line(tmp_path: Path):
    broken = tmp_path / "tokens.cu"
    lines = (CUDA_DIR / "tokens.cu").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "input_ids[i] = " in line)
    lines[at] = lines[at].replace("token_buffer[", "token_bufer[")
    broken.write_text("\n".join(lines))
    proc = _nvcc(broken, tmp_path / "out.cubin")
    assert proc.returncode != 0 and f"tokens.cu({at + 1})" in proc.stderr


def test_cuda_modules_import_without_a_gpu():
    import streams.cuda_kernels  # noqa: F401
    import streams.device_loop  # noqa: F401
    import streams.process_device  # noqa: F401


def _glue_inputs(device: str, dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(6, 4, 2, 8, generator=gen).to(dtype)  # 24 slots of 2 KV heads x 8
    return {
        "input_ids": torch.tensor([5, -1, 7, -1, -1]).to(device),
        "token_slots": torch.tensor([0, 3, 2, 1, 3]).to(device),
        "token_buffer": torch.tensor([10, 11, 12, 13]).to(device),
        "k_cache": cache.to(device),
        "v_cache": (cache * 2).to(device),
        "k": torch.randn(4, 2, 8, generator=gen).to(dtype).to(device),
        "v": torch.randn(4, 2, 8, generator=gen).to(dtype).to(device),
        "slot_mapping": torch.tensor([3, -1, 17, 0]).to(device),  # -1: a graph padding row
    }


def test_the_glue_twins_do_what_plain_indexing_does():
    from streams import cuda_kernels

    x = _glue_inputs("cpu")
    ids = x["input_ids"].clone()
    cuda_kernels.fill_placeholders_twin(ids, x["token_slots"], x["token_buffer"])
    assert ids.tolist() == [5, 13, 7, 11, 13]
    buffer = x["token_buffer"].clone()
    cuda_kernels.scatter_tokens_twin(buffer, torch.tensor([2, 0]), torch.tensor([42, 43]))
    assert buffer.tolist() == [43, 11, 42, 13]
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    cuda_kernels.store_kv_twin(k_cache, v_cache, x["k"], x["v"], x["slot_mapping"])
    want_k, want_v = x["k_cache"].clone().view(24, 2, 8), x["v_cache"].clone().view(24, 2, 8)
    for row, slot in enumerate(x["slot_mapping"].tolist()):
        if slot >= 0:  # the padding row writes nowhere
            want_k[slot], want_v[slot] = x["k"][row], x["v"][row]
    assert torch.equal(k_cache.view(24, 2, 8), want_k) and torch.equal(
        v_cache.view(24, 2, 8), want_v
    )


def test_the_glue_runs_its_twin_on_cpu_tensors():
    from streams import cuda_kernels

    x = _glue_inputs("cpu")
    cuda_kernels.fill_placeholders(x["input_ids"], x["token_slots"], x["token_buffer"])
    assert x["input_ids"].tolist() == [5, 13, 7, 11, 13]


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_glue_kernels_match_their_twins(dtype: torch.dtype):
    pytest.importorskip("cupy")
    from streams import cuda_kernels

    def run(kernels: bool) -> dict:
        x = _glue_inputs("cuda", dtype)
        suffix = "" if kernels else "_twin"
        getattr(cuda_kernels, "fill_placeholders" + suffix)(
            x["input_ids"], x["token_slots"], x["token_buffer"]
        )
        getattr(cuda_kernels, "scatter_tokens" + suffix)(
            x["token_buffer"], x["token_slots"][:2], x["input_ids"][:2]
        )
        getattr(cuda_kernels, "store_kv" + suffix)(
            x["k_cache"], x["v_cache"], x["k"], x["v"], x["slot_mapping"]
        )
        torch.cuda.synchronize()
        return x

    kernels, twins = run(True), run(False)
    assert cuda_kernels._kernel("kv_cache", "store_kv_f32") is not None, "the kernels loaded"
    for name, value in twins.items():
        assert torch.equal(kernels[name], value), name


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


def test_no_kernel_includes_a_header_nvrtc_does_not_ship():
    """The engine compiles cuda/*.cu with NVRTC through CuPy, which has no CUDA headers
    (cuda_bf16.h, cuda_fp16.h, ...) on a host without a toolkit."""
    for source in KERNELS:
        includes = [line for line in source.read_text().splitlines() if line.startswith("#include")]
        assert not includes, f"{source.name}: {includes}"


def test_every_exported_kernel_is_named_for_the_gpu_checks_fallback_check():
    from streams.cuda_kernels import kernel_names

    names = set(kernel_names())
    assert {("kv_cache", "store_kv_bf16"), ("tokens", "fill_placeholders")} <= names
