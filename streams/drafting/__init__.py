"""Drafters for speculative decoding, built in the device process from the configuration:
``ngram`` (prompt lookup), ``suffix`` (suffix decoding over the row and recent requests) and
``draft_model`` (a smaller model with the target's tokenizer)."""

from __future__ import annotations

from typing import Any

from streams.drafting.base import Drafter
from streams.drafting.config import (
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    SpeculativeConfig,
    parse_speculative_config,
)

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "METHODS",
    "Drafter",
    "SpeculativeConfig",
    "build_drafter",
    "parse_speculative_config",
]


def build_drafter(config: SpeculativeConfig, **draft_model: Any) -> Drafter:
    """The configured drafter (module level: a device process receives it in a partial).
    ``draft_model``: what a draft model needs beside the config (device, dtype, blocks)."""
    if config.method == "ngram":
        from streams.drafting.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from streams.drafting.ngram import NgramDrafter
        from streams.drafting.suffix import SuffixDrafter

        return SuffixDrafter(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
            missed=NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max),
        )
    from streams.drafting.draft_model import ModelDrafter

    return ModelDrafter(config, **draft_model)
