"""``--kv-cache-dtype``: a float32 model's KV cache kept in bfloat16 or float16, read back
widened by the attention kernels; and the option's validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_engine.bench.int8_quality import forced_logits
from async_engine.core.config import EngineConfig
from async_engine.core.llm import LLM
from async_engine.model import build_model
from sampler.params import SamplingParams

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 1288, 28, 6653, 30, 2273, 28, 4057, 30, 906]]


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_float32_model_stores_its_cache_in_the_asked_dtype(tiny_model: Path, kv: str):
    model = build_model(str(tiny_model), "float32", kv_cache_dtype=kv)
    k, v = model.allocate_kv_cache(4, 16)[0]
    assert k.dtype == v.dtype == getattr(torch, kv)
    assert model.embed.dtype == torch.float32


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_half_precision_cache_changes_logits_only_by_its_rounding(default_model: Path, kv: str):
    outputs = [[2, 3, 4, 5], [6, 7, 8, 9]]
    full = forced_logits(build_model(str(default_model), "float32"), PROMPTS, outputs)
    half = build_model(str(default_model), "float32", kv_cache_dtype=kv)
    logits = forced_logits(half, PROMPTS, outputs)
    cosine = torch.nn.functional.cosine_similarity(logits, full, dim=-1)
    assert not torch.equal(logits, full)  # the cache really is rounded
    assert cosine.min().item() > 0.999


def test_the_engine_generates_the_same_greedy_tokens_with_a_bfloat16_cache(default_model: Path):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for kv in ("auto", "bfloat16"):
        with LLM(model=str(default_model), dtype="float32", kv_cache_dtype=kv) as llm:
            outs[kv] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    rows = zip(outs["auto"], outs["bfloat16"], strict=True)
    pairs = [(a, b) for x, y in rows for a, b in zip(x, y, strict=True)]
    assert len(pairs) == 48
    assert sum(a == b for a, b in pairs) >= 0.9 * len(pairs)


def test_a_half_precision_model_refuses_a_different_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype float16 needs a float32 model"):
        EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="float16")


def test_a_cache_dtype_equal_to_the_models_is_accepted():
    assert EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype="bfloat16")


def test_the_cache_dtype_is_refused_on_cuda():
    with pytest.raises(ValueError, match="CPU device only"):
        EngineConfig(device="cuda", dtype="float32", kv_cache_dtype="bfloat16")


def test_an_unknown_cache_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto"):
        EngineConfig(kv_cache_dtype="fp8")


def test_build_model_refuses_a_cache_dtype_for_a_half_precision_model(tiny_model: Path):
    with pytest.raises(ValueError, match="needs a float32 model"):
        build_model(str(tiny_model), "bfloat16", kv_cache_dtype="float16")
