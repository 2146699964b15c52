"""One-time conversion of a GGUF checkpoint into a cached HF-style safetensors folder.

Dequantizing the weights and (mostly) converting the GGUF tokenizer take tens of seconds, so
the result is cached and later starts take about a second. A conversion is written into a
temporary folder and renamed into place when complete, so an interrupted one never leaves a
half-written cache behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .config import ModelConfig

# Bump when the cached layout changes: older caches are then converted again.
CACHE_VERSION = 1
MARKER = "async-engine-cache.json"


def default_cache_dir() -> Path:
    env = os.environ.get("ASYNC_ENGINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "async-engine"


def convert_gguf_cached(gguf: Path, cache_dir: Path | None, say: Callable[[str], None]) -> Path:
    """The cached folder for ``gguf``, converting it first if needed."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / gguf.stem
    source = _source_id(gguf)
    if _is_valid(target, source):
        return target
    # Serialise concurrent starts: the second one waits, then finds the cache ready.
    with open(root / f".{gguf.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_valid(target, source):
            return target
        for orphan in root.glob(f".{gguf.stem}.*"):  # left by a killed conversion
            if orphan.is_dir():
                shutil.rmtree(orphan, ignore_errors=True)
        say(f"converting {gguf.name} to safetensors (one time, ~30 s)...")
        tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}.", dir=root))
        try:
            convert_gguf(gguf, tmp)
            (tmp / MARKER).write_text(json.dumps(source))
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
            if target.exists():  # stale: another version or another source file
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"cached at {target}")
    return target


def _source_id(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"version": CACHE_VERSION, "source": str(gguf), "size": stat.st_size}


def _is_valid(folder: Path, source: dict) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == source
    except (OSError, ValueError):
        return False


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into ``out``: model.safetensors, config.json, tokenizer files."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True explicitly: with the `kernels` package installed transformers would
    # otherwise keep the weights packed in GGUF blocks, which we cannot save or run.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    ModelConfig.from_dict(config)  # fail now, not after the slow tokenizer, if unsupported

    state = model.state_dict()
    for name, tensor in state.items():
        if tensor.dtype != torch.float32:
            raise RuntimeError(
                f"GGUF tensor {name} came back as {tensor.dtype}, not dequantized float32"
            )
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if config.get("tie_word_embeddings") and head is not None and torch.equal(head, embed):
        del state["lm_head.weight"]  # tied: safetensors refuses shared tensors anyway
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
