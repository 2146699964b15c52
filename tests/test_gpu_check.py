"""`make gpu-check`'s phase runner, on CPU: every phase lands in the report, a hung phase is
cut at its limit and kept, and the exit status says whether all passed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from async_engine.bench import gpu_check


@pytest.fixture
def phases(monkeypatch):
    table = {
        "good": ([sys.executable, "-c", "print('{\"ok\": true}'); print('not json')"], 30),
        "bad": ([sys.executable, "-c", "import sys; print('{\"ok\": false}'); sys.exit(1)"], 30),
        "hang": ([sys.executable, "-c", "print('{\"started\": 1}', flush=True); "
                  "import time; time.sleep(60)"], 1),
    }  # fmt: skip
    monkeypatch.setattr(gpu_check, "PHASES", table)
    return table


def _report(path: Path) -> dict[str, dict]:
    return {e["phase"]: e for e in map(json.loads, path.read_text().splitlines())}


def test_each_phase_appends_its_records_and_status(tmp_path: Path, phases):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out), "--phases", "good"]) == 0
    assert _report(out)["good"]["records"] == [{"ok": True}] and _report(out)["good"]["status"] == 0


def test_a_failed_or_hung_phase_fails_the_check_and_keeps_what_it_printed(tmp_path: Path, phases):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 1
    report = _report(out)
    assert report["bad"]["status"] == 1 and report["good"]["status"] == 0
    assert report["hang"]["status"] == "timeout" and report["hang"]["records"] == [{"started": 1}]


def test_a_phase_whose_modules_are_missing_fails_naming_them(tmp_path: Path, phases, monkeypatch):
    monkeypatch.setattr(gpu_check, "NEEDS", {"good": ["no_such_module_here"]})
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out), "--phases", "good"]) == 1
    assert _report(out)["good"]["status"] == "missing modules: no_such_module_here"


def test_an_unknown_phase_is_named(tmp_path: Path, phases, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "r.json"), "--phases", "nope"])
    assert "nope" in capsys.readouterr().err


def test_the_kernel_phase_says_when_there_is_no_gpu(capsys):
    from async_engine.bench import gpu_kernels

    if gpu_kernels.torch.cuda.is_available():
        pytest.skip("a GPU is present: make gpu-check runs this phase for real")
    assert gpu_kernels.main() == 1
    assert json.loads(capsys.readouterr().out) == {"error": "no CUDA device"}
