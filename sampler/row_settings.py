"""Each row's sampling settings as tensors indexed by row, declared once in ``SETTINGS``.

A row's settings are copied to the device once, when it joins, in one copy per dtype; a
setting with a host copy answers per-batch questions (which features run, how many top
logprobs) without reading the device. Joining, growing and the values an empty row holds
all derive from the table, so a new sampling parameter is one entry here and its op in
``sampler/sampler.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sampler.noise import seed_to_int64
from sampler.params import SamplingParams

# Below this temperature logits / T overflows float32 for ordinary logit ranges; such
# rows are sampled greedily, which is what the distribution has collapsed to anyway.
GREEDY_EPS = 1e-5


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_EPS


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class Joining:
    """What a setting's value may depend on besides the row's params."""

    vocab_size: int
    rng: random.Random  # seeds for unseeded rows


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    dtype: torch.dtype
    empty: Callable[[int], float | int | bool]  # an empty row's value, by vocab size
    value: Callable[[SamplingParams, Joining], float | int | bool]
    device: bool = True  # kept on the device (the sampler's ops read it there)
    host: bool = False  # kept on the host too (per-batch decisions read it there)


_F32, _I64, _BOOL = torch.float32, torch.int64, torch.bool

SETTINGS: tuple[Setting, ...] = (
    # Greedy rows ride the random draw with a neutral temperature; their draw is discarded.
    Setting("temperature", _F32, lambda v: 1.0, lambda p, j: 1.0 if is_greedy(p) else p.temperature),
    Setting("greedy", _BOOL, lambda v: False, lambda p, j: is_greedy(p), host=True),
    Setting("min_p", _F32, lambda v: 0.0, lambda p, j: p.min_p, host=True),
    # Off is 2.0, above any rounding error of the cumulative sum top-p compares against.
    Setting("top_p", _F32, lambda v: 2.0, lambda p, j: p.top_p if p.top_p < 1.0 else 2.0, host=True),
    # Off (0, -1 or past the vocabulary) is the vocabulary size.
    Setting("top_k", _I64, lambda v: v, lambda p, j: p.top_k if 0 < p.top_k < j.vocab_size else j.vocab_size, host=True),
    Setting("repetition_penalty", _F32, lambda v: 1.0, lambda p, j: p.repetition_penalty),
    Setting("presence_penalty", _F32, lambda v: 0.0, lambda p, j: p.presence_penalty),
    Setting("frequency_penalty", _F32, lambda v: 0.0, lambda p, j: p.frequency_penalty),
    Setting("penalised", _BOOL, lambda v: False, lambda p, j: has_penalty(p), device=False, host=True),
    Setting("repeats", _BOOL, lambda v: False, lambda p, j: p.repetition_penalty != 1.0, device=False, host=True),
    # Every row is seeded: unseeded ones at random when they join.
    Setting("seed", _I64, lambda v: 0, lambda p, j: seed_to_int64(j.rng.getrandbits(64) if p.seed is None else p.seed)),
    Setting("min_tokens", _I64, lambda v: 0, lambda p, j: p.min_tokens, host=True),
    Setting("logprobs", _I64, lambda v: -1, lambda p, j: -1 if p.logprobs is None else p.logprobs, device=False, host=True),
)  # fmt: skip


class RowSettings:
    """The per-row state ``Sampler`` samples from: ``SETTINGS`` and the counters a row starts
    at zero (tokens generated, output counts for penalties, prompt tokens seen, stop ids)."""

    def __init__(
        self, vocab_size: int, device: torch.device | str, rows: int = 64, seed: int | None = None
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._joining = Joining(vocab_size, random.Random(seed))
        R = self.capacity = max(rows, 1)
        V = vocab_size
        self.dev: dict[str, torch.Tensor] = {
            s.name: torch.full((R,), s.empty(V), dtype=s.dtype, device=self.device)
            for s in SETTINGS
            if s.device
        }
        # Host copies: CPU tensors, so a batch's decisions cost a few vectorised ops whatever
        # its size.
        self.host: dict[str, torch.Tensor] = {
            s.name: torch.full((R,), s.empty(V), dtype=s.dtype) for s in SETTINGS if s.host
        }
        self.live = torch.zeros(R, dtype=torch.bool)
        self.banning = torch.zeros(R, dtype=torch.bool)  # has stop ids: min_tokens can ban
        self.generated = torch.zeros(R, dtype=torch.int64, device=self.device)
        self.host_generated = torch.zeros(R, dtype=torch.int64)  # never ahead of the device's
        self.stops = torch.zeros(R, 0, dtype=torch.int64, device=self.device)  # padded with V
        self.counts: torch.Tensor | None = None  # float32 [R, V] output counts, for penalties
        self.prompt_seen: torch.Tensor | None = None  # bool [R, V], for repetition_penalty

    def add_rows(
        self,
        rows: list[int],
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        stop_ids: list[list[int]],
    ) -> None:
        """Rows (re)join: their settings go to the device in one copy per dtype."""
        n = len(rows)
        if not (n == len(params) == len(prompt_ids) == len(stop_ids)):
            raise ValueError("rows, params, prompt_ids and stop_ids must have one entry per row")
        if n == 0:
            return
        if min(rows) < 0 or len(set(rows)) != n:
            raise ValueError(f"rows must be distinct non-negative ints, got {rows}")
        V = self.vocab_size
        stops = [[t for t in s if 0 <= t < V] for s in stop_ids]
        self._grow(max(rows) + 1, max(len(s) for s in stops))
        if self.counts is None and any(has_penalty(p) for p in params):
            self.counts = torch.zeros(self.capacity, V, device=self.device)
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows and self.prompt_seen is None:
            self.prompt_seen = torch.zeros(self.capacity, V, dtype=torch.bool, device=self.device)

        values = {s.name: [s.value(p, self._joining) for p in params] for s in SETTINGS}
        at_host = torch.tensor(rows)
        for name, mirror in self.host.items():
            mirror[at_host] = torch.tensor(values[name], dtype=mirror.dtype)
        self.live[at_host] = True
        self.banning[at_host] = torch.tensor([bool(s) for s in stop_ids])
        self.host_generated[at_host] = 0

        # One host-to-device copy per dtype: the floats, then every int (rows first).
        floats = [s.name for s in SETTINGS if s.device and s.dtype == torch.float32]
        ints = [s.name for s in SETTINGS if s.device and s.dtype != torch.float32]
        f = self._to_device(torch.tensor([values[name] for name in floats], dtype=torch.float32))
        S = self.stops.shape[1]
        padded = [t for s in stops for t in s + [V] * (S - len(s))]  # column V takes the padding
        rep_at = [rows[i] for i in rep_rows]
        seen = [rows[i] * V + t for i in rep_rows for t in prompt_ids[i] if 0 <= t < V]
        head = [*rows, *(int(v) for name in ints for v in values[name])]
        k = self._to_device(torch.tensor(head + padded + rep_at + seen, dtype=torch.int64))
        at = k[:n]
        for name, src in zip(floats, f, strict=True):
            self.dev[name].index_copy_(0, at, src)
        for i, name in enumerate(ints, start=1):
            dst = self.dev[name]
            dst.index_copy_(0, at, k[i * n : (i + 1) * n].to(dst.dtype))
        tail = len(head) + n * S
        self.stops.index_copy_(0, at, k[len(head) : tail].view(n, S))
        self.generated.index_fill_(0, at, 0)
        if self.counts is not None:
            self.counts.index_fill_(0, at, 0.0)
        if self.prompt_seen is not None and rep_rows:
            self.prompt_seen.index_fill_(0, k[tail : tail + len(rep_at)], False)
            self.prompt_seen.view(-1).index_fill_(0, k[tail + len(rep_at) :], True)

    def release_rows(self, rows: list[int]) -> None:
        """Host bookkeeping only: a reused row's device settings are overwritten by add_rows."""
        known = [r for r in rows if 0 <= r < self.capacity]
        self.live[torch.tensor(known, dtype=torch.int64)] = False

    def _grow(self, rows: int, stops: int) -> None:
        """Reallocate for ``rows`` rows and stop lists of ``stops`` ids, keeping live rows."""
        if rows <= self.capacity and stops <= self.stops.shape[1]:
            return
        R = max(rows, 2 * self.capacity) if rows > self.capacity else self.capacity
        V = self.vocab_size

        def grown(old: torch.Tensor, fill: Any = 0) -> torch.Tensor:
            new = old.new_full((R, *old.shape[1:]), fill)
            new[: old.shape[0]] = old
            return new

        empty = {s.name: s.empty(V) for s in SETTINGS}
        self.dev = {name: grown(t, empty[name]) for name, t in self.dev.items()}
        self.host = {name: grown(t, empty[name]) for name, t in self.host.items()}
        self.live, self.banning = grown(self.live), grown(self.banning)
        self.generated, self.host_generated = grown(self.generated), grown(self.host_generated)
        if self.counts is not None:
            self.counts = grown(self.counts)
        if self.prompt_seen is not None:
            self.prompt_seen = grown(self.prompt_seen)
        old_stops = self.stops
        self.stops = old_stops.new_full((R, max(stops, old_stops.shape[1])), V)
        self.stops[: old_stops.shape[0], : old_stops.shape[1]] = old_stops
        self.capacity = R

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            # Pinned, so the copy is queued on the stream instead of waiting for it.
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)
