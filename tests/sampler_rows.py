"""A sampler and its rows for tests: rows added by their params, steps sampled and recorded
as a runner would (each sampled token becomes the row's next output)."""

from __future__ import annotations

import torch

from sampler import Positions, Sample, Sampler, SamplingParams


class SamplerRows:
    def __init__(self, vocab: int, seed: int | None = None, capacity: int = 4) -> None:
        self.sampler = Sampler(vocab, "cpu", rows=capacity, seed=seed)
        self.outputs: dict[int, list[int]] = {}

    def add(
        self, prompt: list[int] | None = None, stop_ids: list[int] | None = None, **params
    ) -> int:
        row = len(self.outputs)
        self.sampler.add_rows([row], [SamplingParams(**params)], [prompt or []], [stop_ids or []])
        self.outputs[row] = []
        return row

    def add_many(self, count: int, **params) -> list[int]:
        return [self.add(**params) for _ in range(count)]

    def emitted(self, row: int, tokens: list[int]) -> None:
        """``tokens`` become ``row``'s outputs without a step (for penalties' counts)."""
        ids = torch.full((len(tokens),), row, dtype=torch.int64)
        self.sampler.record(ids, ids, torch.tensor(tokens, dtype=torch.int64))
        self.outputs[row] += tokens

    def step(self, logits: torch.Tensor, rows: list[int] | None = None, noise=None) -> Sample:
        """One token for each of ``rows`` (default: all, in order), recorded as outputs."""
        rows = list(self.outputs) if rows is None else rows
        at = Positions.one_each(rows, "cpu")
        out = self.sampler.sample(logits, at, noise)
        self.sampler.record(at.rows, at.rows_dev, out.tokens)
        for row, token in zip(rows, out.tokens.tolist(), strict=True):
            self.outputs[row].append(token)
        return out
