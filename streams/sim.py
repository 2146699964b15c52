"""The simulated device's pieces: a step cost model, a precise wait, and the token oracle.

The simulated device runs no model. Each step takes the time the cost model gives, and
each sampled token is a pure function of the token before it, its position and the
request's seed, so any output can be checked against ``oracle_tokens`` under any load,
preemption or cancellation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class CostModel:
    """step_s = step_ms + token_us * tokens + seq_us * sequences + ctx_ns * context tokens."""

    step_ms: float = 1.0
    token_us: float = 0.0
    seq_us: float = 0.0
    ctx_ns: float = 0.0

    def seconds(self, tokens: int, sequences: int, context_tokens: int) -> float:
        return (
            self.step_ms * 1e-3
            + self.token_us * 1e-6 * tokens
            + self.seq_us * 1e-6 * sequences
            + self.ctx_ns * 1e-9 * context_tokens
        )


# Estimates for one H200 (989 dense bf16 TFLOP/s, 4.8 TB/s HBM), not measurements:
# - step_ms: a decode step's floor. 135M: ~30 layers of small kernels under CUDA graphs
#   (~1 ms, the figure measured for small models on current GPUs); 1B: 2.5 GB of bf16
#   weights read once per step (~0.6 ms) plus launch floor; 8B: 16 GB of weights (~3.5 ms)
#   plus floor.
# - token_us: 2 * params FLOPs per token at ~40 % of peak (prefill-bound work).
# - seq_us: per-sequence sampling and metadata work, a few microseconds.
# - ctx_ns: KV bytes per context token (2 * layers * kv_heads * head_dim * 2 bytes) read at
#   ~60 % of HBM bandwidth: 135M 23 KB -> 8 ns, 1B 32 KB -> 11 ns, 8B 128 KB -> 45 ns.
PRESETS: dict[str, CostModel] = {
    "h200-135m": CostModel(step_ms=1.0, token_us=0.7, seq_us=2.0, ctx_ns=8.0),
    "h200-1b": CostModel(step_ms=1.5, token_us=6.3, seq_us=2.0, ctx_ns=11.0),
    "h200-8b": CostModel(step_ms=4.5, token_us=40.0, seq_us=3.0, ctx_ns=45.0),
}
DEFAULT_PRESET = "h200-135m"


def cost_model(
    preset: str | None = None,
    step_ms: float | None = None,
    token_us: float | None = None,
    seq_us: float | None = None,
    ctx_ns: float | None = None,
) -> CostModel:
    """A preset (default h200-135m) with any term given explicitly taking its place."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"sim_preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    base = PRESETS[name]
    return CostModel(
        step_ms=base.step_ms if step_ms is None else float(step_ms),
        token_us=base.token_us if token_us is None else float(token_us),
        seq_us=base.seq_us if seq_us is None else float(seq_us),
        ctx_ns=base.ctx_ns if ctx_ns is None else float(ctx_ns),
    )


class PreciseClock:
    """Waits until a deadline within a few microseconds.

    ``time.sleep`` overshoots by ~80 us at the median and by several hundred at the tail
    on this machine (measured at 0.5-2 ms sleeps), far more than a 1 ms step can absorb.
    So it sleeps until ``margin`` before the deadline and spins the rest (yielding the GIL
    each turn, so a thread beside it, reading the next plan, is not held up). The margin is
    twice the median of recent overshoots: a rare long one (the process was descheduled)
    must not make every later step spin for its whole length.
    """

    def __init__(self, margin_s: float = 200e-6) -> None:
        self.margin_s = margin_s
        self._recent: list[float] = []
        _tighten_timer_slack()

    def wait_until(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining > self.margin_s:
            target = remaining - self.margin_s
            start = time.monotonic()
            time.sleep(target)
            self._learn(time.monotonic() - start - target)
        while time.monotonic() < deadline:
            time.sleep(0)  # releases the GIL: the thread that reads the next plan runs meanwhile

    def _learn(self, overshoot: float) -> None:
        self._recent.append(overshoot)
        if len(self._recent) >= 32:
            median = sorted(self._recent)[len(self._recent) // 2]
            self.margin_s = min(500e-6, max(50e-6, 2 * median))
            self._recent.clear()


def _tighten_timer_slack() -> None:
    """Linux lets a sleep run 50 us late by default; 1 us halves the median overshoot
    measured here (79 -> 37 us at 0.8 ms), so the clock spins less of each step."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass  # another OS: the margin simply stays wider


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def sim_tokens(
    last_tokens: np.ndarray,
    positions: np.ndarray,
    seeds: np.ndarray,
    vocab_size: int,
    avoid: np.ndarray,
) -> np.ndarray:
    """The token that follows ``last_tokens[i]`` at ``positions[i]`` (int64 arrays).

    ``avoid`` (sorted int64) lists ids never produced (the model's EOS ids): the pick moves
    to the next id up, so output lengths are set by max_tokens alone.
    """
    with np.errstate(over="ignore"):
        key = (
            last_tokens.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            + positions.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
            + seeds.astype(np.uint64)
        )
    picks = (_mix(key) % np.uint64(vocab_size)).astype(np.int64)
    for _ in range(avoid.size):  # consecutive EOS ids need as many moves
        hit = picks == avoid[0]
        for other in avoid[1:]:
            hit |= picks == other
        if not hit.any():
            break
        picks[hit] = (picks[hit] + 1) % vocab_size
    return picks


def oracle_tokens(
    prompt: list[int], count: int, seed: int, vocab_size: int, avoid: tuple[int, ...] = ()
) -> list[int]:
    """The tokens the simulated device generates for a prompt: the tests' reference."""
    avoid_arr = np.array(sorted(avoid), dtype=np.int64)
    out: list[int] = []
    seed = text_seed(prompt, seed)
    last, pos = prompt[-1], len(prompt) - 1
    for _ in range(count):
        token = int(
            sim_tokens(np.array([last]), np.array([pos]), np.array([seed]), vocab_size, avoid_arr)[
                0
            ]
        )
        out.append(token)
        last, pos = token, pos + 1
    return out


def request_seed(params: object) -> int:
    """The seed a request's tokens are drawn with: its sampling seed, else 0."""
    seed = getattr(params, "seed", None)
    return 0 if seed is None else int(seed) & ((1 << 63) - 1)


def text_seed(prompt: list[int] | np.ndarray, seed: int) -> int:
    """The seed with the prompt mixed in: each token follows from the one before, its position
    and this, so requests with different prompts never share a continuation (with one seed
    for all, two texts that met at a token and position would run on alike)."""
    tokens = np.asarray(prompt, dtype=np.uint64)
    with np.errstate(over="ignore"):
        weights = _mix(np.arange(1, len(tokens) + 1, dtype=np.uint64))
        mixed = int(_mix(np.array([(tokens * weights).sum()], np.uint64))[0])
    return (seed ^ mixed) & ((1 << 63) - 1)
