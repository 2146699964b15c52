"""Seeded Exp(1) noise from a counter-based hash: element (b, v) depends on
(seeds[b], steps[b], v) only, so a seeded row draws the same noise in any batch, on any device.

The hash is murmur3's fmix32 in int64 torch ops whose products stay below 2**48, so CPU and
CUDA compute the same bits (no overflow, no device-specific rounding).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_SEED_SPAN = 1 << 64


def seed_to_int64(seed: int) -> int:
    """A seed in [0, 2**64) as the int64 with the same bits: torch has no uint64 arithmetic."""
    return seed - _SEED_SPAN if seed >= 1 << 63 else seed


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for h, c < 2**32, in 16-bit halves of c so nothing overflows int64."""
    high = h * (c >> 16)
    high &= 0xFFFF  # only its low 16 bits survive the << 16 mod 2**32
    high <<= 16
    out = h * (c & 0xFFFF)
    out += high
    out &= _M32
    return out


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Exp(1) draws for int64 seeds [B] (two's complement) at steps [B]."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32  # arithmetic shift, so the mask keeps negative seeds' bits
    # A chain of bijections: for one seed, distinct steps give distinct keys.
    key = _fmix32((steps & _M32) ^ 0x9E3779B9)
    key = _fmix32(key ^ hi)
    key = _fmix32(key ^ lo)
    # Spreading v first keeps rows whose keys differ in a few bits from sharing permuted noise.
    ids = _mul32(torch.arange(vocab, dtype=torch.int64, device=seeds.device), 0x27D4EB2F)
    h = _fmix32(key.unsqueeze(1) ^ ids.unsqueeze(0))
    # u in (0, 1) from the top 24 bits. In float64: in float32, (2**24 - 1) + 0.5 rounds up to
    # 2**24, so u would reach 1 and the noise 0.
    u = ((h >> 8).double() + 0.5) * 2.0**-24
    return u.log_().neg_().float()
