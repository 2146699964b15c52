"""How many threads the CPU device takes by default: the cores the process may run on (its
affinity mask), not the machine's count, which a container or taskset may not allow."""

from __future__ import annotations

import os

import pytest

from async_engine.core.config import EngineConfig


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no affinity masks here")
def test_the_default_is_the_affinity_masks_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert EngineConfig(model="default").resolved_device_threads() == 1


def test_a_given_count_is_kept():
    assert EngineConfig(model="default", device_threads=3).resolved_device_threads() == 3
