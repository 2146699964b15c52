"""Speculative decoding through the whole engine: outputs identical with and without it
(each drafter, overlap on and off, chunked prefill, preemption, prefix-cache hits), on the
default model in float32 and on the simulated device; its configuration, opt-out and stats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from async_engine import LLM, SamplingParams

DOC = json.dumps(
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
)
QUOTING = f"Here is a JSON tool call: {DOC}\nRepeat the JSON tool call exactly: "
CPU = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 512}
FAST_SIM = {
    "device": "sim",
    "sim_step_ms": 0.3,
    "sim_token_us": 0,
    "sim_seq_us": 0,
    "sim_ctx_ns": 0,
}


def spec(method: str, k: int = 4, **more) -> dict:
    """Every slot every step: these tests check what speculation emits, not when it pays
    (a timing decision, tests/test_speculation_policy.py)."""
    return {"method": method, "num_speculative_tokens": k, "adaptive": False, **more}


def generate(model: Path, prompts, params, **options) -> tuple[list[list[int]], dict]:
    with LLM(str(model), **options) as llm:
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], llm.stats().as_dict()


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_cpu(default_model: Path) -> list[list[int]]:
    """The default model's greedy tokens, no speculation."""
    prompts = [QUOTING, "The lighthouse keeper walked", QUOTING + DOC[:20]]
    return generate(default_model, prompts, GREEDY, **CPU)[0]


# ------------------------------------------------------------------ the default model
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_output_is_identical_with_speculation(default_model, plain_cpu, method, overlap):
    prompts = [QUOTING, "The lighthouse keeper walked", QUOTING + DOC[:20]]
    got, stats = generate(
        default_model, prompts, GREEDY, overlap=overlap, speculative_config=spec(method), **CPU
    )
    assert got == plain_cpu
    assert stats["spec_num_accepted_tokens"] > 20  # the quote was drafted and kept
    assert stats["spec_mean_accepted_length"] > 2.0


def test_speculation_under_chunked_prefill_preemption_and_prefix_hits(default_model):
    """Six requests sharing a long prefix, a 48-token budget (prompts in chunks) and a pool
    too small for all of them at once (preemption), the second round hitting the cache."""
    prompts = [QUOTING + f"Call {i}: " for i in range(6)]
    options = {**CPU, "num_kv_blocks": 24, "max_num_batched_tokens": 48, "block_size": 16}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = generate(default_model, prompts * 2, params, **options)
    got, stats = generate(
        default_model, prompts * 2, params, speculative_config=spec("ngram"), **options
    )
    assert got == plain
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_num_accepted_tokens"] > 0


def test_seeded_sampled_rows_are_identical_with_speculation(default_model):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)
    plain, _ = generate(default_model, [QUOTING] * 2, params, **CPU)
    got, stats = generate(
        default_model, [QUOTING] * 2, params, speculative_config=spec("ngram"), **CPU
    )
    assert got == plain
    assert stats["spec_num_drafts"] > 0


def test_a_request_that_opts_out_verifies_no_drafts(default_model, plain_cpu):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, speculate=False)
    got, stats = generate(default_model, [QUOTING], params, speculative_config=spec("ngram"), **CPU)
    assert got == plain_cpu[:1]
    assert stats["spec_num_draft_tokens"] == 0


def test_stops_and_max_tokens_cut_an_accepted_run(default_model, plain_cpu):
    """A stop id inside a run of kept drafts ends the request there, as without drafts."""
    quoted = plain_cpu[0]
    stop = quoted[9]  # somewhere inside the quote
    params = SamplingParams(temperature=0, max_tokens=13, stop_token_ids=[stop])
    want, _ = generate(default_model, [QUOTING], params, **CPU)
    got, stats = generate(
        default_model, [QUOTING], params, speculative_config=spec("ngram", 8), **CPU
    )
    assert got == want and got[0][-1] == stop and len(got[0]) <= 13
    limited = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    got, _ = generate(default_model, [QUOTING], limited, speculative_config=spec("ngram", 8), **CPU)
    assert got == [quoted[:7]]


def test_stats_report_acceptance_by_position(default_model):
    _, stats = generate(default_model, [QUOTING], GREEDY, speculative_config=spec("ngram"), **CPU)
    per_position = stats["spec_accepted_per_position"]
    assert len(per_position) == 4 and per_position == sorted(per_position, reverse=True)
    assert per_position[0] <= stats["spec_num_drafts"]
    assert stats["spec_num_accepted_tokens"] == sum(per_position)
    assert 0 < stats["spec_acceptance_rate"] <= 1 and stats["spec_verify_steps"] > 0
    _, plain = generate(default_model, [QUOTING], GREEDY, **CPU)
    assert plain["spec_num_drafts"] == 0 and plain["spec_accepted_per_position"] == []


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"method": "ngram", "lookahead": 3}, "unknown keys: lookahead"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "model": "x"}, "model"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_a_bad_speculative_config_is_a_clear_error_at_start(default_model, config, says):
    with pytest.raises(ValueError, match="speculative_config") as err:
        LLM(str(default_model), speculative_config=config, **CPU)
    assert says in str(err.value)


def test_a_draft_model_on_the_simulated_device_is_refused_at_start(default_model):
    drafting = spec("draft_model", model=str(default_model))
    with pytest.raises(ValueError, match="speculative_config") as err:
        LLM(str(default_model), speculative_config=drafting, **FAST_SIM)
    assert "simulated device runs no model" in str(err.value)


# ------------------------------------------------------------------ the simulated device
def sim_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, int(rng.integers(30, 120))).tolist() for _ in range(count)]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("overlap", [True, False])
def test_the_simulated_devices_repeating_text_is_identical_with_speculation(
    default_model, method, overlap
):
    prompts = sim_prompts(24)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    options = {**FAST_SIM, "sim_repeat": 0.6, "overlap": overlap, "max_num_seqs": 16}
    plain, _ = generate(default_model, prompts, params, **options)
    got, stats = generate(
        default_model, prompts, params, speculative_config=spec(method), **options
    )
    assert got == plain
    assert stats["spec_acceptance_rate"] > 0.5


def test_speculation_on_the_sim_survives_preemption_and_chunked_prefill(default_model):
    prompts = sim_prompts(24, seed=3)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    options = {**FAST_SIM, "sim_repeat": 0.6, "num_kv_blocks": 40, "max_num_batched_tokens": 64}
    plain, _ = generate(default_model, prompts, params, **options)
    got, stats = generate(
        default_model, prompts, params, speculative_config=spec("ngram"), **options
    )
    assert got == plain
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0


# ------------------------------------------------------------------ metrics
def test_spec_decode_metrics_exist_at_zero_and_count_what_was_verified(default_model):
    from server_helpers import start_server
    from test_metrics_every_front_end import call_http, metric, scrape

    from async_engine.server.app import ServerOptions

    srv = start_server(
        default_model,
        ServerOptions(port=0, metrics_port=None, http_port=0),
        speculative_config=spec("ngram"),
    )
    try:
        before = scrape(srv)
        names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        for name in names:
            assert metric(before, f"vllm:spec_decode_{name}_total") == 0, name
        for position in range(4):
            assert (
                metric(
                    before,
                    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    position=str(position),
                )
                == 0
            )
        body = {"model": "default", "prompt": QUOTING, "max_tokens": 40, "temperature": 0}
        call_http(srv, "POST", "/v1/completions", body)
        after = scrape(srv)
        accepted = metric(after, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted > 0 and accepted <= metric(after, "vllm:spec_decode_num_draft_tokens_total")
        per_position = [
            metric(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(4)
        ]
        assert sum(per_position) == accepted and per_position[0] >= per_position[-1]
    finally:
        srv.close()


def test_structured_output_verifies_only_what_its_grammar_allows(default_model, tokenizer):
    """Drafts of a JSON-schema row are verified under the grammar's state after each one (a
    refused draft ends the run): the output is what it is without speculation, and valid."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
        "required": ["name", "arguments"],
    }
    params = SamplingParams(
        temperature=0, max_tokens=60, structured_output=("json_schema", json.dumps(schema))
    )
    # Compact, as the grammar writes JSON, so the quote's tokens are the output's; quoted
    # with spaces, the drafts are tokens the compact grammar refuses, so runs end early.
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    compact = f"Tool call: {json.dumps(call, separators=(',', ':'))}\nRepeat it exactly: "
    # One engine a mode (a device's first grammar costs seconds), one request at a time.
    outputs, drafts = {}, {}
    for mode, options in (("plain", {}), ("ngram", {"speculative_config": spec("ngram")})):
        with LLM(str(default_model), **options, **CPU) as llm:
            for prompt in (compact, QUOTING):
                before = llm.stats().as_dict()
                outputs[mode, prompt] = llm.generate([prompt], params)[0].token_ids
                after = llm.stats().as_dict()
                drafts[mode, prompt] = [
                    after[key] - before[key]
                    for key in ("spec_num_accepted_tokens", "spec_num_draft_tokens")
                ]
    for prompt in (compact, QUOTING):
        assert outputs["ngram", prompt] == outputs["plain", prompt]
    assert drafts["ngram", compact][0] > 5
    text = tokenizer.decode(outputs["ngram", compact], skip_special_tokens=True)
    assert json.loads(text)["arguments"]["city"] == "Paris"
    accepted, drafted = drafts["ngram", QUOTING]
    assert accepted < drafted / 2


# ------------------------------------------------------------------ draft model
def test_the_default_model_drafting_for_itself_keeps_every_greedy_draft(default_model, plain_cpu):
    prompts = [QUOTING, "The lighthouse keeper walked", QUOTING + DOC[:20]]
    drafting = spec("draft_model", model=str(default_model))
    got, stats = generate(default_model, prompts, GREEDY, speculative_config=drafting, **CPU)
    assert got == plain_cpu
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 3


def test_a_tiny_random_draft_model_changes_no_output(default_model, tiny_model, plain_cpu):
    prompts = [QUOTING, "The lighthouse keeper walked", QUOTING + DOC[:20]]
    drafting = spec("draft_model", model=str(tiny_model))
    got, stats = generate(default_model, prompts, GREEDY, speculative_config=drafting, **CPU)
    assert got == plain_cpu
    assert stats["spec_num_draft_tokens"] > 0


def test_a_draft_model_with_another_tokenizer_is_refused_at_start(default_model, tmp_path):
    from tiny_models import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", vocab=160)
    with pytest.raises(ValueError, match="speculative_config.model.*tokenizer"):
        LLM(str(default_model), speculative_config=spec("draft_model", model=str(other)), **CPU)
