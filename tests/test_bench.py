"""The offline benchmark runs end to end (its figures are for the issue note, not asserted)."""

from __future__ import annotations

import json
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


def test_full_batch_decode_time_uses_the_largest_decode_batch():
    import numpy as np

    from async_engine.bench.offline import full_batch_decode_ms
    from streams.plan import StepPlan

    def plan(step: int, lens: list[int]) -> StepPlan:
        n = len(lens)
        return StepPlan(
            step, np.arange(n), np.zeros(n), np.array(lens), np.ones(n, bool), np.zeros(sum(lens))
        )

    plans = [plan(0, [5, 7]), plan(1, [1, 1]), plan(2, [1, 1, 1]), plan(3, [1, 1, 1])]
    spans = [
        (0, 0.0, 0.5, True),
        (1, 1.0, 1.010, False),
        (2, 2.0, 2.004, False),
        (3, 3.0, 3.006, False),
    ]
    ms, batch = full_batch_decode_ms(plans, spans)
    assert batch == 3 and ms == pytest.approx(6.0)


def test_matmul_only_time_is_measured_on_the_models_shapes(tiny_model: Path):
    from async_engine.bench.matmul import matmul_only_ms

    assert matmul_only_ms(str(tiny_model), "float32", batch=4, threads=1, reps=3) > 0


def test_the_llama_server_peer_runs_the_workload(tmp_path: Path):
    import sys

    from async_engine.bench.peers.llama_server import run_llama_server

    fake = Path(__file__).with_name("fake_llama_server.py")
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake}" "$@"\n')
    binary.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = run_llama_server(str(binary), str(gguf), [[5, 6, 7]] * 3, max_tokens=4, threads=1)
    assert out["tokens"] == 12 and out["tokens_per_s"] > 0 and out["slots"] == 3


def test_a_missing_peer_is_named():
    from async_engine.bench.peers import PeerMissingError
    from async_engine.bench.peers.llama_server import run_llama_server

    with pytest.raises(PeerMissingError, match="--llama-server"):
        run_llama_server("/nonexistent/llama-server", "/nonexistent.gguf", [[1]], 1)


def _fake_vllm_python(tmp_path: Path) -> Path:
    """An interpreter path whose `import vllm` finds tests/fake_vllm."""
    import sys

    fake = Path(__file__).with_name("fake_vllm")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{fake}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


def test_the_vllm_peer_runs_the_workload_in_its_own_interpreter(tmp_path: Path, monkeypatch):
    from async_engine.bench.peers.vllm_cpu import run_vllm

    log = tmp_path / "seen.json"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    python = _fake_vllm_python(tmp_path)
    prompts = [[5, 6, 7], [8, 9]]
    out = run_vllm(str(python), "/models/m", "bfloat16", prompts, max_tokens=4, bind="0-1")
    seen = json.loads(log.read_text())
    assert out["tokens"] == 8 and out["tokens_per_s"] > 0 and out["bind"] == "0-1"
    assert seen["prompts"] == prompts and seen["ignore_eos"] is True
    assert (seen["model"], seen["dtype"], seen["bind"]) == ("/models/m", "bfloat16", "0-1")
    assert seen["enforce_eager"] is True and seen["max_num_seqs"] == 2


def test_a_failing_vllm_run_reports_its_output(tmp_path: Path, monkeypatch):
    from async_engine.bench.peers.vllm_cpu import run_vllm

    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "seen.json"))
    python = _fake_vllm_python(tmp_path)
    with pytest.raises(RuntimeError, match="float64 is not supported"):
        run_vllm(str(python), "/models/m", "float64", [[1, 2]], max_tokens=2)


def test_a_missing_vllm_interpreter_is_named():
    from async_engine.bench.peers import PeerMissingError
    from async_engine.bench.peers.vllm_cpu import run_vllm

    with pytest.raises(PeerMissingError, match="--vllm-python"):
        run_vllm("/nonexistent/bin/python", "/models/m", "float32", [[1]], 1)


def test_vllm_binding_all_means_every_core():
    from async_engine.bench.peers.vllm_cpu import vllm_binds

    assert vllm_binds("auto, all", cores=4) == ["auto", "0-3"]
    with pytest.raises(ValueError, match="--vllm-bind"):
        vllm_binds(" , ", cores=4)


def _run_figures() -> dict:
    return {
        "on_tokens_per_s": 200.0,
        "off_tokens_per_s": 190.0,
        "roofline_tokens_per_s": 250.0,
        "on_steady_decode_idle": 0.0,
        "off_steady_decode_idle": 0.0,
        "on_idle": 0.0,
        "off_idle": 0.0,
        "on_ms_per_step": 1.0,
        "off_ms_per_step": 1.1,
        "on_phase_ms": {},
        "off_phase_ms": {},
        "on_decode_control_ms": 0.1,
        "on_wasted_tokens": 0,
    }


def test_the_table_prints_a_ratio_for_each_peer(capsys):
    from async_engine.bench.offline_table import print_table

    run = _run_figures()
    peers = [
        {"name": "llama-server", "tokens_per_s": 100.0, "detail": "2 threads"},
        {"name": "vLLM bind=auto", "tokens_per_s": 50.0, "detail": "eager"},
    ]
    print_table({"cpu": run}, None, peers=peers)
    out = capsys.readouterr().out
    assert "overlap on / llama-server" in out and "overlap on / vLLM bind=auto" in out
    assert "4.00" in out.split("overlap on / vLLM bind=auto")[1].splitlines()[0]


def test_the_table_prints_without_peers(capsys):
    from async_engine.bench.offline_table import print_table

    print_table({"cpu": _run_figures()}, None)
    assert "overlap on / off" in capsys.readouterr().out
