"""The JSONL batch CLI, and LLM instances that come and go in one process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from async_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run_cli(args: list[str], stdin: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "async_engine.cli.main", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_cli_answers_each_jsonl_line_in_order(tiny_model: Path):
    lines = [
        {"id": "a", "prompt": "Hello there", "max_tokens": 4, "temperature": 0},
        {"id": "b", "prompt_token_ids": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
        {"id": "c", "prompt": "x", "temperature": -1},
        {"id": "d", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        {"id": "e", "prompt_token_ids": [5], "max_tokens": 2, "bogus": 1},
    ]
    stdin = "\n".join(json.dumps(x) for x in lines) + "\nnot json\n"
    proc = run_cli(["generate", "--model", str(tiny_model), "--dtype", "float32"], stdin)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o.get("id") for o in out[:5]] == ["a", "b", None, "d", None]
    assert len(out[1]["token_ids"]) == 3 and out[1]["finish_reason"] == "length"
    assert "temperature" in out[2]["error"]
    assert "bogus" in out[4]["error"]
    assert "error" in out[5]
    assert isinstance(out[0]["text"], str) and out[3]["prompt_tokens"] > 1


def test_llm_instances_can_follow_each_other(tiny_model: Path):
    first = LLM(str(tiny_model), dtype="float32", device="cpu")
    a = first.generate([[5, 6, 7]], GREEDY)[0].token_ids
    first.close()
    first.close()  # twice is harmless
    with LLM(str(tiny_model), dtype="float32", device="cpu") as second:
        assert second.generate([[5, 6, 7]], GREEDY)[0].token_ids == a


def test_a_process_that_never_closes_its_llm_still_exits_cleanly(tiny_model: Path):
    script = (
        "from async_engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model)!r}, dtype='float32', device='cpu')\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "print(len(out[0].token_ids))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "3"


def test_a_closed_llm_refuses_work(tiny_model: Path):
    llm = LLM(str(tiny_model), dtype="float32", device="cpu")
    llm.close()
    try:
        llm.generate([[1, 2]], GREEDY)
    except RuntimeError as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("generate on a closed LLM must raise")


def kept(devices: list) -> Callable:
    """A device wrapper that keeps each device the engine starts."""
    return lambda device: devices.append(device) or device


def test_a_closed_llm_leaves_its_device_process_ended_with_status_0(tiny_model: Path):
    devices = []
    llm = LLM(str(tiny_model), dtype="float32", device="cpu", device_wrapper=kept(devices))
    llm.generate([[5, 6, 7]], GREEDY)
    llm.close()
    assert devices[0]._proc.returncode == 0


def test_an_unreadable_tokenizer_fails_the_start_and_leaves_no_device_process(
    tiny_model: Path, tmp_path: Path
):
    """The tokenizer loads while the device process starts: its failure ends that process."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "tokenizer.json").write_text("{not json")
    devices = []
    with pytest.raises(ValueError, match="cannot load the tokenizer in .*model"):
        LLM(str(folder), dtype="float32", device="cpu", device_wrapper=kept(devices))
    assert len(devices) == 1 and devices[0]._proc.returncode is not None
