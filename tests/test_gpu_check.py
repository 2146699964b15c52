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
        "hang": (
            [
                sys.executable,
                "-c",
                "print('{\"started\": 1}', flush=True); import time; time.sleep(60)",
            ],
            1,
        ),
    }
    monkeypatch.setattr(gpu_check, "PHASES", table)
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: True)
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


def test_a_phase_is_cut_even_when_a_child_it_left_holds_its_output(tmp_path: Path, monkeypatch):
    """Like a hung device process: the phase exits, its child keeps the pipes open."""
    leave = (
        "import subprocess, sys; print('{\"ok\": 1}', flush=True); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    )
    monkeypatch.setattr(gpu_check, "PHASES", {"leaves": ([sys.executable, "-c", leave], 2)})
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: True)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 1
    report = _report(out)["leaves"]
    assert report["status"] == "timeout" and report["records"] == [{"ok": 1}]
    assert report["seconds"] < 10


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


def test_the_phases_run_in_order_within_one_device_call_and_name_their_modules():
    names = ["compile", "kernels", "identity", "pytest-cuda", "bench", "profile", "speculation"]
    assert list(gpu_check.PHASES) == names
    on_gpu = [n for n in names if gpu_check.skip_reason(n, gpu=True) is None]
    assert on_gpu == names[1:]
    assert sum(gpu_check.PHASES[n][1] for n in on_gpu) < 10 * 60 - 30
    assert set(gpu_check.NEEDS) == set(gpu_check.PHASES)


def test_without_a_gpu_the_gpu_phases_are_skipped_and_the_rest_must_pass(
    tmp_path: Path, phases, monkeypatch
):
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: False)
    monkeypatch.setitem(gpu_check.PHASES, "kernels", gpu_check.PHASES["bad"])
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out), "--phases", "good,kernels"]) == 0
    report = _report(out)
    assert report["kernels"]["status"] == "skipped: no GPU" and report["good"]["status"] == 0
    assert gpu_check.main(["--out", str(out), "--phases", "bad,kernels"]) == 1


def test_the_compile_phase_runs_only_where_no_gpu_runs_the_kernels():
    """On a GPU host the kernels phase compiles and runs the same kernels."""
    assert gpu_check.skip_reason("compile", gpu=False) is None
    assert gpu_check.skip_reason("compile", gpu=True).startswith("skipped")
    assert gpu_check.COMPILE[1:3] == ["-m", "async_engine.model.gpu_kernels.aot"]


def test_each_phases_time_limit_on_this_host_is_printed_before_the_run(
    tmp_path: Path, phases, monkeypatch, capsys
):
    monkeypatch.setattr(gpu_check, "gpu_present", lambda: False)
    monkeypatch.setitem(gpu_check.PHASES, "kernels", gpu_check.PHASES["good"])
    gpu_check.main(["--out", str(tmp_path / "r.json"), "--phases", "good,kernels"])
    printed = capsys.readouterr().out
    assert "budget on this host (no GPU):" in printed
    assert "good           30 s" in printed and "kernels         - (skipped: no GPU)" in printed
    assert "total          30 s" in printed


def _wheel(folder: Path, name: str, files: dict[str, str]) -> None:
    import zipfile

    folder.mkdir(exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_carried_wheels_are_importable_by_the_phases(tmp_path: Path, phases, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the wheels first: undo after
    monkeypatch.delenv("PYTHONPATH", raising=False)
    files = {"carried_mod.py": "VALUE = 7\n", "carried-1.0.data/purelib/carried_data.py": ""}
    _wheel(tmp_path / "wheels", "carried", files)
    code = "import json, carried_mod, carried_data; print(json.dumps({'v': carried_mod.VALUE}))"
    monkeypatch.setitem(gpu_check.PHASES, "good", ([sys.executable, "-c", code], 30))
    monkeypatch.setattr(gpu_check, "NEEDS", {"good": ["carried_mod", "carried_data"]})
    out = tmp_path / "report.json"
    args = ["--out", str(out), "--phases", "good", "--wheels", str(tmp_path / "wheels")]
    assert gpu_check.main(args) == 0
    assert _report(out)["good"]["records"] == [{"v": 7}]


# --- the engine phases' logic, on CPU ----------------------------------------------------------
def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_identity_compares_the_pipelined_runner_with_the_cpu_engine(capsys):
    """The GPU phase's own comparison, device under test "cpu": the pipelined runner there."""
    from async_engine.bench import gpu_identity

    argv = "--device cpu --shapes tiny --variants overlap-on,preempt,chunked --bf16 off".split()
    assert gpu_identity.main(argv) == 0
    records = {r["variant"]: r for r in _records(capsys.readouterr().out)}
    assert set(records) == {"cpu-reference", "overlap-on", "preempt", "chunked"}
    assert all(
        r["ok"] and r["mismatches"] == [] for n, r in records.items() if n != "cpu-reference"
    )
    assert records["preempt"]["preemptions"] > 0


def test_a_token_mismatch_fails_the_identity_phase_and_names_where(monkeypatch, capsys):
    from async_engine.bench import gpu_identity

    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    top = [[[(1, -0.1), (9, -0.3)]] * 3, None, None]

    def generate(folder, options, prompts, params):
        tokens = ref if options is gpu_identity.REFERENCE else [[1, 2, 3], [4, 5, 0], [7]]
        return {"tokens": tokens, "top": top, "preemptions": 1, "seconds": 0.0}

    monkeypatch.setattr(gpu_identity, "generate", generate)
    assert not gpu_identity.check_shape("tiny", Path("unused"), "cpu", ["overlap-off"], False)
    _, record = _records(capsys.readouterr().out)
    assert record["ok"] is False
    assert record["mismatches"] == [
        {"prompt": 1, "index": 2, "want": 6, "got": 0},
        {"prompt": 2, "index": 1, "want": 8, "got": None},
    ]
    margin = gpu_identity.first_mismatches([[1, 2]], [[9, 2]], top)[0]["ref_margin"]
    assert margin == pytest.approx(0.2)


def test_a_variant_that_crashes_fails_the_phase_and_the_next_still_runs(monkeypatch, capsys):
    from async_engine.bench import gpu_identity

    def generate(folder, options, prompts, params):
        if options.get("overlap") is False:
            raise RuntimeError("device lost")
        return {"tokens": [[1]], "top": [None], "preemptions": 0, "seconds": 0.0}

    monkeypatch.setattr(gpu_identity, "generate", generate)
    variants = ["overlap-off", "chunked"]
    assert not gpu_identity.check_shape("tiny", Path("unused"), "cpu", variants, False)
    _, crashed, chunked = _records(capsys.readouterr().out)
    assert crashed["ok"] is False and "device lost" in crashed["error"]
    assert chunked["ok"] is True


def test_bench_phase_reads_a_real_offline_run(capsys):
    from async_engine.bench import gpu_bench

    argv = "--device cpu --dtype float32 --shape tiny --batches 4 --max-tokens 8".split()
    assert gpu_bench.main(argv) == 0
    on, off, summary = _records(capsys.readouterr().out)
    assert (on["cuda_graphs"], off["cuda_graphs"]) == (True, False)
    assert on["on_tokens_per_s"] > 0 and 0 <= on["steady_decode_busy_on"] <= 1
    assert summary["graphs_ratio"]["4"] == pytest.approx(
        on["on_tokens_per_s"] / off["on_tokens_per_s"]
    )
    assert all(isinstance(v, bool) for v in summary["targets"].values())


def test_bench_targets_are_reported_from_the_runs_that_completed():
    from async_engine.bench.gpu_bench import summary

    def run(batch: int, graphs: bool, tps: float, ratio: float, busy: float) -> dict:
        return {
            "batch": batch,
            "cuda_graphs": graphs,
            "on_tokens_per_s": tps,
            "overlap_ratio": ratio,
            "steady_decode_busy_on": busy,
        }

    got = summary(
        [
            run(64, True, 300, 1.3, 0.96),
            run(64, False, 250, 1.0, 0.9),
            run(256, True, 900, 1.1, 0.99),
        ]
    )
    assert got["graphs_ratio"] == {"64": pytest.approx(1.2)}
    assert got["overlap_ratio"] == {"64": 1.3, "256": 1.1}
    assert got["targets"] == {
        "steady_decode_busy_at_64_ge_0.95": True,
        "overlap_ratio_at_64_ge_1.2": True,
        "graphs_ratio_at_64_ge_1.5": False,
    }
    assert summary([run(64, True, 300, 1.3, 0.96)])["targets"]["graphs_ratio_at_64_ge_1.5"] is None


def test_profile_phase_reads_the_reports_of_a_real_run(capsys):
    from async_engine.bench import gpu_profile

    argv = "--device cpu --dtype float32 --shape tiny --steps 20 --requests 4".split()
    assert gpu_profile.main(argv) == 0
    on, off, compare = _records(capsys.readouterr().out)
    assert (on["overlap"], off["overlap"]) == ("on", "off")
    for r in (on, off):
        assert r["tokens"] == 80 and r["tokens_per_s"] > 0
        assert r["busy"] + r["idle"] == pytest.approx(1.0, abs=2e-3)
        assert r["gaps"]["all"]["count"] > 0 and r["head"].startswith("== overlap")
    assert "overlap on" in compare["compare"]


def test_profile_figures_that_were_not_measured_read_as_none():
    from async_engine.bench.gpu_profile import report_figures

    text = "device busy n/a, idle n/a (busy 0 s)\n  all                 0       n/a       n/a       n/a"
    figures = report_figures(text)
    assert figures["busy"] is None and figures["idle"] is None
    assert figures["gaps"]["all"] == {"count": 0, "p50_ms": None, "p95_ms": None, "max_ms": None}


def test_the_identity_phase_says_when_there_is_no_gpu(capsys):
    import torch

    from async_engine.bench import gpu_identity

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: make gpu-check runs this phase for real")
    assert gpu_identity.main([]) == 1
    assert json.loads(capsys.readouterr().out) == {"error": "no CUDA device"}


@pytest.mark.parametrize("shape", ["tiny", pytest.param("smollm2-135m", marks=pytest.mark.slow)])
def test_the_speculation_phase_verifies_accepted_and_rejected_drafts_on_the_cpu(capsys, shape):
    """The phase's prompts and weights, on the tiny shape (the shape it runs on the GPU,
    smollm2-135m, in the slow suite: 40 s here): every variant's tokens match plain
    decoding with some drafts accepted and some rolled back."""
    from async_engine.bench import gpu_spec

    assert gpu_spec.main(["--device", "cpu", "--checks", "identity", "--shape", shape]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in records] == list(gpu_spec.VARIANTS)
    assert all(r["verify_steps"] > 0 and 0 < r["acceptance"] < 1 for r in records)


def test_the_speculation_phase_measures_each_method_against_off_on_the_cpu(capsys):
    """Tokens/s and device idle for plain decoding and for each method at every batch size
    (the tiny shape; on the GPU, smollm2-135m)."""
    from async_engine.bench import gpu_spec

    assert gpu_spec.main(["--device", "cpu", "--checks", "speed", "--shape", "tiny"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = [(m, b) for m in gpu_spec.SPEED_METHODS for b in gpu_spec.BATCHES]
    assert [(r["method"], r["batch"]) for r in records] == want
    for r in records:
        assert r["ok"] and r["tokens_per_s"] > 0 and r["off_tokens_per_s"] > 0
        assert 0 <= r["device_idle"] <= 1 and 0 <= r["off_device_idle"] <= 1
    for method in gpu_spec.SPEED_METHODS:
        assert sum(r["verify_steps"] for r in records if r["method"] == method) > 0
