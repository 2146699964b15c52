"""Whether a draft model can draft for a target: the same vocabulary, token for token.

A draft token is verified as the target's token of the same id, so the two tokenizers must
agree on every id; a draft model whose tokenizer differs would be verified against the wrong
text. Checked once, at start, from the folders' config.json and tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from .loader import load_model_config


def check_draft_model(target: Path, draft: Path) -> None:
    """Raise ValueError naming speculative_config.model if ``draft`` cannot draft for
    ``target``."""
    want, got = load_model_config(target).vocab_size, load_model_config(draft).vocab_size
    if want != got:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {got} tokens, the target's has "
            f"{want}: a draft model needs the target's tokenizer"
        )
    vocabularies = [_vocabulary(folder) for folder in (target, draft)]
    if None in vocabularies:
        raise ValueError(
            "speculative_config.model: both models need a tokenizer.json, to check that "
            "they share one"
        )
    if vocabularies[0] != vocabularies[1]:
        raise ValueError(
            "speculative_config.model: its tokenizer differs from the target's (a draft "
            "model needs the target's tokenizer)"
        )


def _vocabulary(folder: Path) -> dict | None:
    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        return None
    with open(path) as f:
        data = json.load(f)
    model = data.get("model", {})
    return {
        "vocab": model.get("vocab"),
        "added": [t.get("content") for t in data.get("added_tokens", [])],
    }
