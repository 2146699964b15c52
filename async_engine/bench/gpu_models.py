"""What ``make gpu-check``'s engine phases share: model folders written on the spot and the
``async-engine`` commands run in-process.

The GPU host has neither the default model (its wheel is too big to carry) nor a package
index, so the phases write their own folders: the tiny shape and SmolLM2-135M's shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

# SmolLM2-135M-Instruct's config.json, the fields the engine reads (the default model's shape).
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHAPES: dict[str, dict[str, Any]] = {"tiny": TINY, "smollm2-135m": SMOLLM2_135M}
# Larger than HF's 0.02, the embedding most (it is also the head when tied): logits get clear
# winners, so float32 rounding differences between devices cannot flip a pick on a near-tie.
WEIGHT_STD = 0.1
EMBED_STD = 0.25


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def write_model(
    folder: Path,
    config: dict[str, Any],
    seed: int = 0,
    weights: bool = True,
    weight_std: float = WEIGHT_STD,
) -> Path:
    """config.json, and unless ``weights`` is False a model.safetensors of random weights
    under HF names, so that every device loads the same numbers (``weight_std`` for all but
    the embedding and head)."""
    from safetensors.torch import save_file

    from async_engine.model import LlamaModel, ModelConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if not weights:
        return folder
    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):  # shapes only, no memory
        targets = LlamaModel(cfg, torch.float32)._weight_targets()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, target in targets.items():
        per_head = name.endswith(("q_norm.weight", "k_norm.weight"))
        shape = target.shape[-1:] if per_head else target.shape
        noise = torch.randn(shape, generator=gen)
        # Norms near 1, jittered so a mixed-up norm shows.
        std = EMBED_STD if name.endswith(("embed_tokens.weight", "lm_head.weight")) else weight_std
        tensors[name] = noise * std if len(shape) > 1 else 1.0 + 0.1 * noise
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def run_cli(argv: list[str]) -> int:
    """An ``async-engine bench|profile`` command through the CLI's own parsers, in-process.

    Not through ``async_engine.cli.main``: that imports the server and client (grpc,
    protobuf), which these commands never use and the GPU host may have in other versions.
    Their printed tables go to stderr, so stdout stays one JSON record per line.
    """
    import async_engine.cli.bench as bench
    import async_engine.cli.profile as profile

    parser = argparse.ArgumentParser(prog="async-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (bench, profile):
        command.add_parser(sub)
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):
        return int(args.func(args))
