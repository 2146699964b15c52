"""Speculative decoding's Prometheus series, by vLLM's names: drafts verified, draft tokens,
accepted tokens, and accepted tokens by draft position. They exist from the start, at 0
(with no speculation configured, they stay there)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from async_engine.core.stats import EngineStats


class SpeculationMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name"]
        self.drafts = Counter(
            "vllm:spec_decode_num_drafts",
            "Row-steps that verified at least one draft token",
            labels,
            registry=registry,
        )
        self.draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified", labels, registry=registry
        )
        self.accepted = Counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted",
            labels,
            registry=registry,
        )
        self.per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0: the first)",
            [*labels, "position"],
            registry=registry,
        )
        for counter in (self.drafts, self.draft_tokens, self.accepted):
            counter.labels(model_name)  # at 0 from the start
        self._last: dict[str, int] = {}

    def refresh(self, stats: EngineStats) -> None:
        name = self.model_name
        for key, counter, value in (
            ("drafts", self.drafts, stats.spec_num_drafts),
            ("draft_tokens", self.draft_tokens, stats.spec_num_draft_tokens),
            ("accepted", self.accepted, stats.spec_num_accepted_tokens),
        ):
            self._grow(key, counter.labels(name), value)
        for position, value in enumerate(stats.spec_accepted_per_position):
            self._grow(f"position{position}", self.per_position.labels(name, str(position)), value)

    def _grow(self, key: str, child: Counter, value: int) -> None:
        grown = value - self._last.get(key, 0)
        if grown > 0:
            child.inc(grown)
        self._last[key] = value
