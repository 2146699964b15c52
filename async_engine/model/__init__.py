"""The model layer: config parsing, the Llama-family implementation, loading and caching.

Importing this package pulls in torch but never transformers or asyncio: transformers is
imported lazily by the functions that convert GGUF files.
"""

from .attention import paged_attention
from .attention_plan import AttentionPlan
from .config import ModelConfig, RopeScaling
from .draft_check import check_draft_model
from .gguf_cache import default_cache_dir
from .llama import KVCache, LlamaModel, rope_inv_freq
from .loader import build_model, init_dummy_weights, load_model_config, resolve_model

__all__ = [
    "AttentionPlan",
    "KVCache",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "build_model",
    "check_draft_model",
    "default_cache_dir",
    "init_dummy_weights",
    "load_model_config",
    "paged_attention",
    "resolve_model",
    "rope_inv_freq",
]
