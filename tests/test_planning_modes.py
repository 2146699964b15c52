"""How the overlap loop plans step N+1: the mode is named in stats() and can be pinned."""

from __future__ import annotations

import pytest

from async_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompt(n: int, start: int = 100) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


def test_stats_name_how_steps_are_planned(tiny_model, monkeypatch):
    with LLM(
        str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=64, overlap=False
    ) as sync:
        sync.generate([prompt(5)], GREEDY)
        assert sync.stats().planning_mode == "sync"
    with LLM(str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        # control plane: never a sliver
        monkeypatch.setattr(llm.engine.clock, "PLAN_AFTER_STEP_BELOW", 0.0)
        llm.generate([prompt(5)], GREEDY)
        assert llm.stats().planning_mode == "overlap"
        monkeypatch.setattr(llm.engine.clock, "PLAN_AFTER_STEP_BELOW", 1e9)  # always a sliver
        llm.generate([prompt(5)], GREEDY)
        assert llm.stats().planning_mode == "after-step"


@pytest.mark.parametrize("planning", ["overlap", "after-step"])
def test_planning_setting_pins_how_steps_are_planned(tiny_model, planning):
    options = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "planning": planning}
    with LLM(str(tiny_model), **options) as llm:
        llm.generate([prompt(5)], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert llm.stats().planning_mode == planning


def test_unknown_planning_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="planning"):
        LLM(str(tiny_model), dtype="float32", device="cpu", planning="eager")
