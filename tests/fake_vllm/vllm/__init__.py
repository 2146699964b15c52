"""A stand-in for vLLM's offline API (LLM, SamplingParams): enough for bench offline's vLLM
peer driver to be tested without vLLM. It writes what it was given to $FAKE_VLLM_LOG."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, temperature: float, max_tokens: int, ignore_eos: bool) -> None:
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class LLM:
    def __init__(self, model: str, dtype: str, **kwargs: object) -> None:
        if dtype == "float64":
            raise ValueError("fake vLLM: float64 is not supported")
        self.seen = {"model": model, "dtype": dtype, **kwargs}
        self.seen["bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")

    def generate(self, prompts: list, params: SamplingParams, use_tqdm: bool = True) -> list:
        self.seen["prompts"] = [p["prompt_token_ids"] for p in prompts]
        self.seen["ignore_eos"] = params.ignore_eos
        with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
            json.dump(self.seen, f)
        print("INFO fake vLLM log line")
        out = SimpleNamespace(token_ids=list(range(params.max_tokens)))
        return [SimpleNamespace(outputs=[out]) for _ in prompts]
