"""The model layer's loading: resolving and caching models (GGUF conversion), config parsing,
and imports light enough for the CPU engine. The forward's parity with HF transformers is
checked in tests/test_model_forward.py."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_llama

from async_engine.model import ModelConfig, build_model, resolve_model, rope_inv_freq

MODEL_DIR = Path(__file__).resolve().parents[1] / "async_engine" / "model"


@pytest.fixture(scope="session")
def default_folder() -> Path:
    return resolve_model("default")


# --- resolving and caching ------------------------------------------------------------------


def test_resolve_default_is_cached(default_folder: Path) -> None:
    lines: list[str] = []
    start = time.perf_counter()
    again = resolve_model("SmolLM2-135M-Instruct", progress=lines.append)
    assert again == default_folder
    assert time.perf_counter() - start < 3.0 and lines == []  # no second conversion
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_folder / name).is_file(), name
    from safetensors import safe_open

    with safe_open(str(default_folder / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied to the embedding, dropped
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.float32 and tuple(embed.shape) == (49152, 576)  # dequantized
    config = json.loads((default_folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config


def test_resolve_rejects_unknown(tmp_path: Path, default_folder: Path) -> None:
    assert resolve_model(str(default_folder)) == default_folder
    with pytest.raises(ValueError, match="expected 'default'"):
        resolve_model("meta-llama/Llama-3-8B")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))  # an empty folder
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()  # weights are build_model's job


def test_conversion_is_atomic_and_cached(tmp_path: Path, monkeypatch) -> None:
    from async_engine.model import gguf_cache

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really gguf")
    cache = tmp_path / "cache"
    calls = []

    def interrupted(src: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    def complete(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_cache, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf), cache_dir=cache, progress=None)
    assert [p.name for p in cache.iterdir()] == [".tiny.lock"]  # no half-written cache

    monkeypatch.setattr(gguf_cache, "convert_gguf", complete)
    lines: list[str] = []
    first = resolve_model(str(gguf), cache_dir=cache, progress=lines.append)
    assert first == cache / "tiny" and (first / "config.json").is_file()
    assert lines[0].startswith("converting tiny.gguf") and lines[-1] == f"cached at {first}"
    assert resolve_model(str(gguf), cache_dir=cache, progress=None) == first and len(calls) == 1


@pytest.mark.slow
def test_fresh_gguf_conversion(tmp_path: Path, default_folder: Path) -> None:
    from async_engine.model.loader import _default_gguf

    folder = resolve_model(str(_default_gguf()), cache_dir=tmp_path, progress=None)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in default_folder.iterdir()
    )


# --- config parsing -------------------------------------------------------------------------

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_config_llama3() -> None:
    cfg = ModelConfig.from_dict(LLAMA)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 32, 8, 128)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == "llama3"
    assert (
        cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_position_embeddings == 8192
    )
    assert cfg.eos_token_ids == [128001, 128008, 128009] and cfg.bos_token_id == 128000
    assert not cfg.attention_bias and not cfg.qk_norm and not cfg.tie_word_embeddings


def test_config_rope_parameters_layout() -> None:
    raw = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    raw["eos_token_id"] = 2
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling.rope_type == "default"
    assert cfg.eos_token_ids == [2]


def test_config_qwen_and_mistral() -> None:
    base = {k: v for k, v in LLAMA.items() if k != "rope_scaling"}
    qwen2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 256})
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 256
    mistral = ModelConfig.from_dict(
        {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert mistral.architecture == "MistralForCausalLM"


def test_config_rejects_unsupported() -> None:
    with pytest.raises(
        ValueError, match="unsupported architecture GPT2LMHeadModel; supported: Llama"
    ):
        ModelConfig.from_dict({**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_inv_freq_matches_hf(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    if rope["rope_type"] == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg)
    ours = rope_inv_freq(
        ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    )
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


# --- loading --------------------------------------------------------------------------------


def test_unsupported_architecture_at_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({**LLAMA, "architectures": ["PhiForCausalLM"]})
    )
    with pytest.raises(ValueError, match="unsupported architecture PhiForCausalLM"):
        build_model(str(tmp_path), "float32")


def test_tiny_with_tokenizer(tmp_path: Path, default_folder: Path) -> None:
    from transformers import AutoTokenizer

    folder = make_tiny_llama(tmp_path, tokenizer_from=default_folder, num_layers=1)
    model = build_model(str(folder), "bfloat16")
    assert model.cfg.vocab_size == len(AutoTokenizer.from_pretrained(folder)) == 49152
    assert model.cfg.eos_token_ids == [2]


# --- import hygiene -------------------------------------------------------------------------


def test_import_is_light() -> None:
    code = "import sys, async_engine.model; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    for path in MODEL_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only; lazy imports are fine
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("asyncio", "transformers"), f"{path.name}: {name}"
