"""Greedy float32 output equals HF transformers generate() token for token (default model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_engine import LLM, SamplingParams

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(default_model: Path, mixed_prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model), dtype=torch.float32)
    model.eval()
    refs = []
    with torch.inference_mode():
        for prompt in mixed_prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            refs.append(out[0, len(prompt) :].tolist())
    return refs


def run(default_model: Path, prompts: list[list[int]], **options) -> tuple[list, object]:
    # min_tokens bans EOS exactly like HF's min_new_tokens, so both run all 32 steps.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    # A 64-token budget chunks the longer prompts and mixes prefill with decode.
    with LLM(
        str(default_model), dtype="float32", device="cpu", max_num_batched_tokens=64, **options
    ) as llm:
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], llm.stats()


def test_greedy_equals_hf_with_overlap(default_model, mixed_prompts, hf_reference):
    outs, _ = run(default_model, mixed_prompts, overlap=True)
    assert outs == hf_reference


def test_greedy_equals_hf_without_overlap(default_model, mixed_prompts, hf_reference):
    outs, _ = run(default_model, mixed_prompts, overlap=False)
    assert outs == hf_reference


def test_greedy_equals_hf_when_a_small_kv_pool_forces_preemption(
    default_model, mixed_prompts, hf_reference
):
    # 40 blocks of 16 tokens cannot hold all eight sequences (about 65 blocks at the end).
    outs, stats = run(default_model, mixed_prompts, overlap=True, num_kv_blocks=40)
    assert stats.num_preemptions > 0
    assert outs == hf_reference
