"""`bench spec`: speculation off vs each drafter, both workloads, by batch size (its figures
are for the issue note, not asserted); how it finds where a method's tokens first differ."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from async_engine.bench.agent_workload import conversations
from async_engine.bench.spec import first_difference_margins
from async_engine.bench.spec_table import agreement, margin_summary
from async_engine.cli.main import main


def test_bench_spec_compares_every_method_with_off_on_both_workloads(tmp_path: Path, capsys):
    out = tmp_path / "spec.json"
    argv = "bench spec --device sim --sim-step-ms 0.3 --sim-token-us 0 --sim-seq-us 0"
    argv += " --sim-ctx-ns 0 --batches 1,2 --max-tokens 16 --min-requests 2"
    assert main([*argv.split(), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for workload in ("agent", "plain"):
        runs = report["runs"][workload]
        assert set(runs) == {"off", "ngram", "suffix"}
        for method in runs.values():
            assert set(method) == {"1", "2"}
            assert all(run["tokens"] == 16 * max(2, 2 * int(b)) for b, run in method.items())
        for agree in report["agreement"][workload].values():
            assert agree == {"agreement": 1.0, "first_difference": None}  # exact on the sim
    assert report["runs"]["agent"]["ngram"]["1"]["accepted_length"] > 1.0  # the text repeats
    printed = capsys.readouterr().out
    assert "agent workload" in printed and "plain workload" in printed and "x)" in printed


def test_rounds_pool_every_methods_runs_with_new_prompts_each_round(tmp_path: Path, capsys):
    out = tmp_path / "spec.json"
    argv = "bench spec --device sim --sim-step-ms 0.3 --sim-token-us 0 --sim-seq-us 0"
    argv += " --sim-ctx-ns 0 --batches 2 --max-tokens 8 --min-requests 2 --methods ngram"
    assert main([*argv.split(), "--rounds", "3", "--workloads", "plain", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]["plain"]
    for run in (runs["off"]["2"], runs["ngram"]["2"]):
        assert run["tokens"] == 3 * 4 * 8  # three rounds of four requests
        assert len(run["round_tokens_per_s"]) == 3
        assert abs(run["tokens_per_s"] - run["tokens"] / run["seconds"]) < 1e-9
    assert "each round's ratio to off, lowest-highest: 2: ngram " in capsys.readouterr().out


def test_rounds_below_one_are_refused():
    import pytest

    with pytest.raises(SystemExit, match="--rounds"):
        main(["bench", "spec", "--device", "sim", "--rounds", "0"])


def test_a_negative_agent_history_is_refused():
    import pytest

    with pytest.raises(SystemExit, match="--agent-history"):
        main(["bench", "spec", "--device", "sim", "--agent-history", "-1"])


def test_agent_history_puts_earlier_tool_exchanges_before_each_loops_last_turn():
    plain = conversations(4, seed=5)
    long = conversations(4, seed=5, history=3)
    assert plain == conversations(4, seed=5, history=0)  # no history: the workload as it was
    for short, longer in zip(plain, long, strict=True):
        assert len(longer) == len(short) + 4 * 3  # asked, called, answered, acknowledged
        roles = [m["role"] for m in longer[1:]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]  # alternating
        results = [m["content"] for m in longer[1:13] if m["content"].startswith("Tool result")]
        assert len(results) == 3
        assert longer[-1]["content"].startswith("Tool result")  # still ends asking for a quote


def test_the_loops_of_one_session_share_their_earlier_exchanges():
    loops = conversations(8, seed=5, history=2)
    earlier = [loop[1:9] for loop in loops]
    assert earlier[0] == earlier[1] == earlier[2] == earlier[3]  # one session
    assert earlier[4] == earlier[7] and earlier[4] != earlier[0]  # the next
    assert len({str(loop[9:]) for loop in loops}) == 8  # each loop's own last turn


def test_agreement_counts_positions_up_to_each_first_difference():
    off = {1: {"outputs": [[1, 2, 3, 4], [5, 6, 7, 8]], "prompts": [[9], [10]]}}
    ngram = {1: {"outputs": [[1, 2, 0, 0], [5, 6, 7, 8]], "prompts": [[9], [10]]}}
    got = agreement({"off": off, "ngram": ngram})["ngram"]
    assert got == {"agreement": 6 / 8, "first_difference": 2, "differences": [([9], 2)]}


def test_the_margin_at_a_difference_is_offs_gap_between_its_top_two(tiny_model: Path):
    from async_engine import LLM, SamplingParams

    prompt = [5, 6, 7, 8]
    options = {"model": str(tiny_model), "device": "cpu", "dtype": "float32"}
    margins = asyncio.run(first_difference_margins(options, [(prompt, 3)]))
    with LLM(**options) as llm:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
        top = llm.generate([prompt], params)[0].top_logprobs[3]
    want = top[0][1] - top[1][1]
    assert len(margins) == 1 and abs(margins[0] - want) < 1e-4 and want >= 0
    assert "median" in margin_summary(margins) and margin_summary([]) == ""
