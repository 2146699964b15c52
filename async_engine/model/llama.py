"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over packed batches.

Numerics follow HF transformers (RMSNorm in float32, rotate-half RoPE computed in float32 then
cast) so greedy float32 output matches ``generate()`` token for token. Speed comes from few
Python-level ops per layer: q/k/v and gate/up are fused into one matmul each, RoPE runs on q and
k together, and the step's attention layout is planned once per forward (``AttentionPlan``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from streams.batch import ForwardBatch

from . import cpu_kernels, gpu_kernels
from .attention import paged_attention
from .attention_plan import AttentionPlan, TritonAttention
from .config import ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]
PACK_BATCH_HINT = 32  # rows oneDNN tunes the packed layout for: a decode batch


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32, computed the way transformers does."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The fused kernel keeps float32 statistics for half-precision inputs, like HF's
    # LlamaRMSNorm, in one op instead of five; in half precision it rounds once where HF
    # rounds twice. A [heads, D] weight (Qwen3 q/k norm) cannot go into the kernel.
    if weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def linear(
    x: torch.Tensor, weight: torch.Tensor | nn.Module, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(weight, nn.Module):  # a quantized layer (quantization.py) in the weight's place
        return weight(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a [out, in] CPU weight, or ``weight`` itself where unsupported.

    oneDNN otherwise re-blocks the weight on every call: packing once makes decode-sized
    matmuls ~20% faster in bf16 and ~2x in float32 (measured on AVX-512 with one thread).
    """
    if isinstance(weight, nn.Module) or weight.device.type != "cpu":  # quantized: packed already
        return weight
    if not torch.backends.mkldnn.is_available():
        return weight
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        linear(torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed)  # usable here?
    except (RuntimeError, AttributeError):  # e.g. fp16 on a CPU without AVX512-FP16
        return weight
    return nn.Parameter(packed, requires_grad=False)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.qk_heads = cfg.num_heads + cfg.num_kv_heads
        self.inter = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        hidden, qkv_rows = cfg.hidden_size, (self.qk_heads + cfg.num_kv_heads) * cfg.head_dim
        self.input_norm = _param(hidden, dtype=dtype)
        self.qkv = _param(qkv_rows, hidden, dtype=dtype)
        self.qkv_bias = _param(qkv_rows, dtype=dtype) if cfg.attention_bias else None
        # Qwen3: q_norm's weight repeated over the q heads, k_norm's over the kv heads, so one
        # norm covers both.
        self.qk_norm = _param(self.qk_heads, cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.o_proj = _param(hidden, cfg.num_heads * cfg.head_dim, dtype=dtype)
        self.post_norm = _param(hidden, dtype=dtype)
        self.gate_up = _param(2 * cfg.intermediate_size, hidden, dtype=dtype)
        self.down = _param(hidden, cfg.intermediate_size, dtype=dtype)

    def pack_weights(self) -> None:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            setattr(self, name, pack_weight(getattr(self, name)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        fused = cpu_kernels.elementwise_apply(x)  # CPU, float32 or bf16: one pass per op
        norm = cpu_kernels.rms_norm if fused else rms_norm
        qkv = linear(norm(x, self.input_norm, self.eps), self.qkv, self.qkv_bias)
        qk = qkv[:, : self.qk_heads * self.head_dim].view(tokens, self.qk_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        if fused and qk.stride(1) == self.head_dim:
            qk = cpu_kernels.rope(qk, cos[:, 0], sin[:, 0])
        else:
            # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: one op, not slice+neg+cat.
            qk = qk * cos + torch.roll(qk, self.head_dim // 2, -1) * sin
        v = qkv[:, self.qk_heads * self.head_dim :].view(tokens, self.num_kv_heads, self.head_dim)
        attn = paged_attention(
            qk[:, : self.num_heads], qk[:, self.num_heads :], v, kv[0], kv[1], slot_mapping, plan
        )
        x = x + linear(attn, self.o_proj)
        gate_up = linear(norm(x, self.post_norm, self.eps), self.gate_up)
        if fused:
            return x + linear(cpu_kernels.silu_mul(gate_up), self.down)
        return x + linear(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :], self.down)


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        # The KV cache's dtype: the model's, or bf16/fp16 under a float32 model on a CPU: half
        # the memory, and half the bytes the attention kernels read (they widen as they load).
        self.kv_dtype = kv_dtype or dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed if cfg.tie_word_embeddings else _param(*self.embed.shape, dtype=dtype)
        )
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # Decode attention through two bmm's is faster in half precision, SDPA in float32.
        self.decode_bmm = dtype != torch.float32

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """Per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim], zeroed."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        device = self.embed.device
        return [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=device),
                torch.zeros(shape, dtype=self.kv_dtype, device=device),
            )
            for _ in range(self.cfg.num_layers)
        ]

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Float32 logits [S, vocab] for the rows in ``batch.logits_indices``."""
        if len(kv_cache) != len(self.layers):
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, model has {len(self.layers)}")
        k_cache = kv_cache[0][0]
        plan = batch.attention or AttentionPlan.build(
            batch, k_cache.shape[1], self.decode_bmm, k_cache, q_dtype=self.dtype
        )
        cos, sin = self._rope(batch.positions)
        x = F.embedding(batch.input_ids, self.embed)
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            x = layer(x, cos, sin, kv, batch.slot_mapping, plan)
        x = rms_norm(x[batch.logits_indices], self.norm, self.cfg.rms_norm_eps)
        return linear(x, self.lm_head).float()

    def triton_attention_runs(self, block_size: int) -> bool:
        """Whether the Triton kernels attend here: a CUDA model with triton, and blocks whose
        power-of-two size of at least 16 their dots take."""
        fits = block_size >= 16 and block_size & (block_size - 1) == 0
        return fits and self.embed.is_cuda and gpu_kernels.available()

    @staticmethod
    def device_attention(
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        context_lens: torch.Tensor,
        max_query_len: int,
        num_tokens: int,
    ) -> AttentionPlan:
        """A step's attention plan for the Triton kernels from tensors already on the device
        (``ForwardBatch.attention``): no host lists, so a CUDA graph can capture it."""
        kernels = TritonAttention(block_tables, q_starts, q_lens, context_lens, max_query_len)
        return AttentionPlan.for_triton(kernels, num_tokens)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [T, 1, head_dim] in model dtype (HF rounds them the same)."""
        freqs = positions.float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), -1)
        sin = torch.cat((-sin, sin), -1)
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def pack_weights(self) -> None:
        """Switch matmul weights to oneDNN's packed layout (CPU); call after load_weights."""
        for layer in self.layers:
            layer.pack_weights()
        # A tied head gets its own packed copy: the embedding lookup needs the plain one.
        self.lm_head = pack_weight(self.lm_head)

    @torch.no_grad()
    def load_weights(self, folder: str | Path) -> None:
        """Load HF-named tensors from every ``*.safetensors`` in ``folder``."""
        from safetensors import safe_open

        if self.layers[0].qkv.is_mkldnn:
            raise RuntimeError("load_weights must come before pack_weights")
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        targets = self._weight_targets()
        missing = set(targets)
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                        continue  # some tied checkpoints still store a copy
                    if name not in targets:
                        raise ValueError(f"{file.name}: unexpected tensor {name}")
                    dest = targets[name]
                    tensor = f.get_tensor(name)
                    # q_norm/k_norm are [D] in the checkpoint and [heads, D] here.
                    per_head = name.endswith(("q_norm.weight", "k_norm.weight"))
                    expected = dest.shape[-1:] if per_head else dest.shape
                    if tuple(tensor.shape) != tuple(expected):
                        raise ValueError(
                            f"{name}: shape {tuple(tensor.shape)}, expected {tuple(expected)}"
                        )
                    dest.copy_(tensor)
                    missing.discard(name)
        if missing:
            raise ValueError(f"weights missing from {folder}: {sorted(missing)[:5]}")

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the slice of our (fused) parameter it fills."""
        cfg = self.cfg
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        targets = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not cfg.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            attn = pre + "self_attn."
            qkv_parts = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}
            for p, (start, rows) in qkv_parts.items():
                targets[f"{attn}{p}_proj.weight"] = layer.qkv.narrow(0, start, rows)
                if layer.qkv_bias is not None:
                    targets[f"{attn}{p}_proj.bias"] = layer.qkv_bias.narrow(0, start, rows)
            if layer.qk_norm is not None:
                # A [heads, D] expand of the [D] checkpoint weight, written back via copy_.
                targets[attn + "q_norm.weight"] = layer.qk_norm[: cfg.num_heads]
                targets[attn + "k_norm.weight"] = layer.qk_norm[cfg.num_heads :]
            targets[attn + "o_proj.weight"] = layer.o_proj
            targets[pre + "mlp.gate_proj.weight"] = layer.gate_up[: cfg.intermediate_size]
            targets[pre + "mlp.up_proj.weight"] = layer.gate_up[cfg.intermediate_size :]
            targets[pre + "mlp.down_proj.weight"] = layer.down
            targets[pre + "input_layernorm.weight"] = layer.input_norm
            targets[pre + "post_attention_layernorm.weight"] = layer.post_norm
        return targets
