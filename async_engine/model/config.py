"""Model hyper-parameters read straight from an HF ``config.json``.

Plain Python on purpose: the device process parses this before anything heavy is imported,
so it must not pull in transformers (seconds of import time) or even torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architecture -> (q/k/v carry a bias, per-head RMSNorm on q and k). All four share one
# decoder layout, so one implementation serves them; SmolLM ships as LlamaForCausalLM.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an HF config dict; raise ValueError for anything this engine cannot run."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        implied_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")

        hidden = _required(raw, "hidden_size")
        heads = _required(raw, "num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}"
            )
        rope_params = _rope_parameters(raw)
        partial = rope_params.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported")
        max_pos = int(raw.get("max_position_embeddings", 2048))

        return cls(
            architecture=arch,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_layers=_required(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_params.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(rope_params, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=implied_bias or bool(raw.get("attention_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=_int_list(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _required(raw: dict[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return int(raw[key])


def _int_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge the old (``rope_theta`` + ``rope_scaling``) and new (``rope_parameters``) layouts."""
    params: dict[str, Any] = {}
    if raw.get("rope_theta") is not None:
        params["rope_theta"] = raw["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        section = raw.get(key)
        if isinstance(section, dict):
            params.update({k: v for k, v in section.items() if v is not None})
    return params


def _rope_scaling(params: dict[str, Any], max_pos: int) -> RopeScaling:
    # Old configs spell the key "type"; transformers accepts both.
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeScaling("default")
    if "factor" not in params:
        raise ValueError(f"rope_type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    return RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_pos)
        ),
    )
