"""A synthetic workload: random prompt token ids, greedy decoding of a fixed length.

Shared by the offline bench and the profiler (which uses one prompt length: min == max).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sampler.params import SamplingParams


@dataclass(slots=True)
class Workload:
    num_requests: int = 32
    min_prompt: int = 20  # prompt lengths are drawn uniformly from min_prompt..max_prompt
    max_prompt: int = 300
    max_tokens: int = 64  # new tokens per request (ignore_eos: exactly this many)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "min_prompt", "max_prompt", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_prompt > self.max_prompt:
            raise ValueError(
                f"min_prompt ({self.min_prompt}) must not exceed max_prompt ({self.max_prompt})"
            )

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        low = min(100, vocab_size // 2)  # skip the special tokens many tokenizers put first
        return [
            [
                rng.randrange(low, vocab_size)
                for _ in range(rng.randint(self.min_prompt, self.max_prompt))
            ]
            for _ in range(self.num_requests)
        ]

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
