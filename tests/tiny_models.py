"""Tiny random-weight HF model folders for fast tests (the runtime never writes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_tiny_llama(
    folder: str | Path,
    *,
    tokenizer_from: Path | None = None,
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int | None = None,
    architecture: str = "LlamaForCausalLM",
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight HF model folder (safetensors) for fast tests.

    ``overrides`` go to the HF config (e.g. rope_parameters, tie_word_embeddings).
    """
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if tokenizer_from is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
        vocab = len(tokenizer)
    model_cls = getattr(transformers, architecture, None)
    if model_cls is None:
        raise ValueError(f"transformers has no {architecture}")
    settings: dict[str, Any] = {
        "vocab_size": vocab or 128,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        # HF's 0.02 makes attention nearly uniform in a tiny model, which would hide mask and
        # position bugs; larger weights give peaked attention and distinct logits.
        "initializer_range": 0.2,
    }
    if tokenizer is not None:
        settings["bos_token_id"] = tokenizer.bos_token_id
        settings["eos_token_id"] = tokenizer.eos_token_id
        settings["pad_token_id"] = tokenizer.pad_token_id
    settings.update(overrides)
    config = model_cls.config_class(**settings)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        # HF initialises norms to 1 and biases to 0; jitter them so they are actually tested.
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
