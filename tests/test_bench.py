"""The offline benchmark runs end to end (its figures are for the issue note, not asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_engine.bench.offline import Workload, compare_modes


def test_offline_bench_measures_both_modes_and_the_roofline(tiny_model: Path):
    work = Workload(num_requests=4, min_prompt=5, max_prompt=40, max_tokens=6)
    options = {"model": str(tiny_model), "dtype": "float32", "device": "cpu"}
    result = compare_modes(options, work.prompts(1000), work.max_tokens, rounds=1)
    assert result["on_tokens_per_s"] > 0 and result["off_tokens_per_s"] > 0
    assert result["roofline_tokens_per_s"] > 0
    assert result["runs_on"][0]["tokens"] == 4 * 6
    assert 0.0 <= result["on_steady_decode_idle"] <= 1.0


def test_one_workload_serves_the_bench_and_the_profiler():
    from async_engine.core.workload import Workload as Shared

    assert Workload is Shared
    fixed = Workload(num_requests=3, min_prompt=7, max_prompt=7, max_tokens=5, seed=1)
    prompts = fixed.prompts(1000)
    assert [len(p) for p in prompts] == [7, 7, 7] and prompts == fixed.prompts(1000)
    assert all(100 <= t < 1000 for p in prompts for t in p)
    assert fixed.params().max_tokens == 5 and fixed.params().ignore_eos
    with pytest.raises(ValueError, match="min_prompt"):
        Workload(min_prompt=9, max_prompt=8)
