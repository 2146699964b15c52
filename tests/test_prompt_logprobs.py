"""Prompt logprobs (``SamplingParams.prompt_logprobs``; on HTTP ``echo`` and vLLM's
``prompt_logprobs``): each prompt token's logprob under the model, as eval harnesses score
multiple-choice answers. They equal transformers' log-softmax on the same float32 weights,
across chunked prefill and whatever the prefix cache holds. Tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from server_helpers import http_server
from test_http import raw
from transformers import AutoModelForCausalLM

from async_engine import LLM, SamplingParams

PROMPT = [1, 5, 9, 33, 100, 7, 8, 2000, 17, 4, 9, 12, 99, 3, 41, 42, 43, 5, 6, 77] * 3
ENGINE = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128, "block_size": 16}


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """transformers' log-softmax at every position of a prompt."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    return logprobs


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    # A 60-token prompt in chunks of 24: three prefill steps.
    with LLM(str(tiny_model), max_num_batched_tokens=24, **ENGINE) as engine:
        yield engine


def scored(llm, prompt: list[int], top: int = 2, **params) -> list:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top, **params)
    return llm.generate([prompt], params)[0].prompt_logprobs


def test_each_prompt_tokens_logprob_equals_transformers_across_chunked_prefill(llm, reference):
    got = scored(llm, PROMPT)
    want = reference(PROMPT)
    assert got[0] is None and len(got) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        assert got[i][PROMPT[i]] == pytest.approx(want[i - 1, PROMPT[i]].item(), abs=1e-4)


def test_the_top_n_at_each_position_are_the_likeliest_tokens(llm, reference):
    got = scored(llm, PROMPT, top=3)
    want = reference(PROMPT)
    for i in range(1, len(PROMPT)):
        top = want[i - 1].topk(3)
        for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert got[i][token] == pytest.approx(value, abs=1e-4)
        assert len(got[i]) in (3, 4)  # the prompt token, unless it is among the top 3


def test_a_cached_prefix_does_not_skip_the_positions_a_request_scores(tiny_model):
    with LLM(str(tiny_model), enable_prefix_cache=True, **ENGINE) as llm:
        greedy = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([PROMPT], greedy)  # its blocks are cached now
        again = llm.generate([PROMPT], greedy)[0]
        assert again.num_cached_tokens > 0
        first = scored(llm, PROMPT)
        second = scored(llm, PROMPT)
    assert None not in first[1:] and first == second


def test_rows_that_do_not_ask_are_unchanged_beside_one_that_does(llm):
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate([[7, 8, 9, 10]], plain)[0].token_ids
    both = llm.generate(
        [PROMPT, [7, 8, 9, 10]],
        [SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1, ignore_eos=True), plain],
    )
    assert both[1].token_ids == alone and both[1].prompt_logprobs is None
    assert both[0].prompt_logprobs is not None


def test_a_prompt_logprobs_setting_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


# ------------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = http_server(tiny_model, max_num_batched_tokens=24)
    yield srv
    srv.close()


def complete(server, **body) -> tuple[int, dict]:
    payload = {"model": "default", "temperature": 0, **body}
    status, _, out = raw(server, "POST", "/v1/completions", json.dumps(payload).encode())
    return status, json.loads(out)


def test_lm_evals_request_scores_the_prompt_and_shows_nothing_generated(server, reference):
    # What lm-eval's local-completions sends for a loglikelihood request.
    status, answer = complete(server, prompt=[PROMPT], max_tokens=0, logprobs=1, echo=True)
    assert status == 200, answer
    (choice,) = answer["choices"]
    lp = choice["logprobs"]
    want = reference(PROMPT)
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        assert lp["token_logprobs"][i] == pytest.approx(want[i - 1, PROMPT[i]].item(), abs=1e-4)
    assert answer["usage"]["completion_tokens"] == 0
    assert choice["text"] == server.engine.tokenizer.decode(PROMPT, False)


def test_echo_with_tokens_to_generate_puts_the_prompt_first(server):
    prompt = "The lighthouse keeper"
    status, answer = complete(server, prompt=prompt, max_tokens=3, logprobs=0, echo=True)
    assert status == 200, answer
    choice = answer["choices"][0]
    n_prompt = answer["usage"]["prompt_tokens"]
    assert choice["text"].startswith(prompt)
    assert len(choice["logprobs"]["tokens"]) == n_prompt + 3
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_a_streamed_echo_adds_up_to_the_whole_one(server):
    body = {"model": "default", "prompt": "Once upon", "max_tokens": 4, "temperature": 0,
            "echo": True, "stream": True}  # fmt: skip
    status, _, out = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200
    events = [json.loads(line[6:]) for line in out.decode().splitlines()
              if line.startswith("data: {")]  # fmt: skip
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    _, whole = complete(server, prompt="Once upon", max_tokens=4, echo=True)
    assert streamed == whole["choices"][0]["text"] and streamed.startswith("Once upon")


def test_max_tokens_zero_without_echo_is_a_400_naming_it(server):
    status, answer = complete(server, prompt="hi", max_tokens=0)
    assert status == 400 and answer["error"]["param"] == "max_tokens"


def test_the_prompt_logprobs_extension_answers_vllms_shape(server, reference):
    status, answer = complete(server, prompt=PROMPT[:10], max_tokens=1, prompt_logprobs=1)
    assert status == 200, answer
    got = answer["choices"][0]["prompt_logprobs"]
    want = reference(PROMPT[:10])
    assert got[0] is None and len(got) == 10
    entry = got[3][str(PROMPT[3])]
    assert entry["logprob"] == pytest.approx(want[2, PROMPT[3]].item(), abs=1e-4)
    assert entry["rank"] == int((want[2] > want[2, PROMPT[3]]).sum()) + 1


def test_a_chat_echo_is_still_refused(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "echo": True}
    status, _, out = raw(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(out)["error"]["param"] == "echo"


# ------------------------------------------------------------------------ gRPC
async def test_grpc_sends_the_prompt_logprobs_on_the_first_chunk(server, reference):
    from async_engine.client import AsyncClient, Chunk

    async with AsyncClient(server.address) as client:
        events = [e async for e in client.generate(PROMPT[:12], max_tokens=3, temperature=0.0,
                                                    ignore_eos=True, prompt_logprobs=2)]  # fmt: skip
    chunks = [e for e in events if isinstance(e, Chunk)]
    first, later = chunks[0].prompt_logprobs, [c.prompt_logprobs for c in chunks[1:]]
    want = reference(PROMPT[:12])
    assert len(first) == 11 and all(not p for p in later)
    for i, (logprob, rank, top) in enumerate(first, 1):
        assert logprob == pytest.approx(want[i - 1, PROMPT[i]].item(), abs=1e-4)
        assert rank == int((want[i - 1] > want[i - 1, PROMPT[i]]).sum()) + 1
        assert [t for t, _ in top] == want[i - 1].topk(2).indices.tolist()


async def test_grpc_refuses_prompt_logprobs_out_of_range(server):
    from async_engine.client import AsyncClient, InvalidArgument

    async with AsyncClient(server.address) as client:
        with pytest.raises(InvalidArgument, match="prompt_logprobs"):
            async for _ in client.generate("hi", max_tokens=1, prompt_logprobs=99):
                pass
