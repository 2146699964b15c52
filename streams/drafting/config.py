"""The speculative-decoding configuration, as vLLM's users write it: a JSON object such as
``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}``. A bad one is a ValueError naming the key, at start.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a row's token buffer keeps 64 positions: 2 steps of 1 + 16 fit


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # draft slots a row gets at most a step
    # ngram (prompt lookup): the longest and shortest suffix of a row's tokens to look up
    # earlier in its prompt and output.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # suffix: match depth, finished requests kept, drafts per matched token (the draft
    # length grows with the match), and the least frequency a drafted continuation needs.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: a smaller model with the target's tokenizer.
    model: str | None = None
    # Adaptive: each row's draft slots from its measured acceptance and the measured cost
    # of a step's extra tokens (false: always num_speculative_tokens).
    adaptive: bool = True
    # Speculate in no step with more running requests than this (None: no limit).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        for name, low, high in (
            ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
            ("suffix_decoding_max_tree_depth", 1, 256),
            ("suffix_decoding_max_cached_requests", 0, 1_000_000),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(
                    f"speculative_config.{name} must be an int in [{low}, {high}], got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, "
                f"got {self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )
        for name, low, high in (
            ("suffix_decoding_max_spec_factor", 0.0, 64.0),
            ("suffix_decoding_min_token_prob", 0.0, 1.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"speculative_config.{name} must be a number, got {value!r}")
            if not low <= value <= high:
                raise ValueError(
                    f"speculative_config.{name} must be in [{low}, {high}], got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be a bool, got {self.adaptive!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be a positive int, got {limit!r}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config.model is needed with method "draft_model"')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'speculative_config.model is for "draft_model", not {self.method!r}')


def parse_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """A config from a JSON string (the command line), a dict (``LLM(...)``) or itself."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown keys: {', '.join(map(str, unknown))}")
    if "method" not in value:
        # vLLM infers draft_model from a model key alone.
        if "model" not in value:
            raise ValueError("speculative_config.method is required")
        value = {**value, "method": "draft_model"}
    return SpeculativeConfig(**value)
