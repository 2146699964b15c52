"""Each row's sampling settings as device tensors indexed by row, with host mirrors.

A row's settings are copied to the device once, when it joins, in one copy per dtype; the
host mirrors answer every per-batch question (which features run, how many top logprobs)
without reading the device. Tensors grow, keeping live rows, as rows and stop lists do.
"""

from __future__ import annotations

import random

import torch

from sampler.noise import seed_to_int64
from sampler.params import SamplingParams
from sampler.sampler import _GREEDY_EPS, _has_penalty


class RowSettings:
    """The per-row state ``DeviceSampler`` samples from."""

    def __init__(
        self, vocab_size: int, device: torch.device | str, rows: int = 64, seed: int | None = None
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._rng = random.Random(seed)  # seeds for unseeded rows
        dev, R = self.device, max(rows, 1)
        # Device settings per row, as Sampler turns SamplingParams into tensors.
        self._temp = torch.ones(R, device=dev)  # 1 for greedy rows, as in Sampler
        self._min_p = torch.zeros(R, device=dev)
        self._top_p = torch.ones(R, device=dev)  # 2.0 when off, as in Sampler
        self._rep = torch.ones(R, device=dev)
        self._pres = torch.zeros(R, device=dev)
        self._freq = torch.zeros(R, device=dev)
        self._greedy = torch.zeros(R, dtype=torch.bool, device=dev)
        self._top_k = torch.zeros(R, dtype=torch.int64, device=dev)  # vocab when off
        self._seed = torch.zeros(R, dtype=torch.int64, device=dev)
        self._min_tokens = torch.zeros(R, dtype=torch.int64, device=dev)
        self._generated = torch.zeros(R, dtype=torch.int64, device=dev)
        self._stops = torch.zeros(R, 0, dtype=torch.int64, device=dev)  # padded with vocab
        self._counts: torch.Tensor | None = None  # float32 [R, V] output counts, for penalties
        self._prompt_seen: torch.Tensor | None = None  # bool [R, V], for repetition_penalty
        # Host mirrors, for decisions that must not read the device: CPU tensors, so a batch's
        # decisions cost a few vectorised ops whatever its size (the package avoids numpy).
        self._live = torch.zeros(R, dtype=torch.bool)
        self._h_greedy = torch.zeros(R, dtype=torch.bool)
        self._h_penalised = torch.zeros(R, dtype=torch.bool)
        self._h_rep = torch.zeros(R, dtype=torch.bool)
        self._h_min_p = torch.zeros(R, dtype=torch.float64)
        self._h_top_k = torch.zeros(R, dtype=torch.int64)
        self._h_top_p = torch.ones(R, dtype=torch.float64)
        self._h_banning = torch.zeros(R, dtype=torch.bool)  # has stop ids: min_tokens can ban
        self._h_min_tokens = torch.zeros(R, dtype=torch.int64)
        self._h_generated = torch.zeros(R, dtype=torch.int64)
        self._h_logprobs = torch.full((R,), -1, dtype=torch.int64)  # -1: did not ask
        self.capacity = R

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
        if self._counts is None and any(_has_penalty(p) for p in params):
            self._counts = torch.zeros(self.capacity, V, device=self.device)
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows and self._prompt_seen is None:
            self._prompt_seen = torch.zeros(self.capacity, V, dtype=torch.bool, device=self.device)

        greedy = [p.temperature < _GREEDY_EPS for p in params]
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        floats = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.min_p for p in params],
                # Off is 2.0, above any rounding error of the cumsum, as in Sampler.
                [p.top_p if p.top_p < 1.0 else 2.0 for p in params],
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            ],
            dtype=torch.float32,
        )
        seeds = [self._rng.getrandbits(64) if p.seed is None else p.seed for p in params]
        S = self._stops.shape[1]
        padded = [t for s in stops for t in s + [V] * (S - len(s))]  # column V takes the padding
        rep_at = [rows[i] for i in rep_rows]
        seen = [rows[i] * V + t for i in rep_rows for t in prompt_ids[i] if 0 <= t < V]
        head = [*rows, *greedy, *top_k, *map(seed_to_int64, seeds), *(p.min_tokens for p in params)]
        ints = torch.tensor(head + padded + rep_at + seen, dtype=torch.int64)
        tail = len(head) + n * S

        at_host = torch.tensor(rows)
        self._live[at_host] = True
        for mirror, values in (
            (self._h_greedy, greedy),
            (self._h_penalised, [_has_penalty(p) for p in params]),
            (self._h_rep, [p.repetition_penalty != 1.0 for p in params]),
            (self._h_min_p, [p.min_p for p in params]),
            (self._h_top_k, top_k),
            (self._h_top_p, [p.top_p for p in params]),
            (self._h_banning, [bool(s) for s in stop_ids]),
            (self._h_min_tokens, [p.min_tokens for p in params]),
            (self._h_logprobs, [-1 if p.logprobs is None else p.logprobs for p in params]),
        ):
            mirror[at_host] = torch.tensor(values, dtype=mirror.dtype)
        self._h_generated[at_host] = 0

        f, k = self._to_device(floats), self._to_device(ints)
        at = k[:n]
        for dst, src in zip(
            (self._temp, self._min_p, self._top_p, self._rep, self._pres, self._freq),
            f,
            strict=True,
        ):
            dst.index_copy_(0, at, src)
        self._greedy.index_copy_(0, at, k[n : 2 * n].bool())
        self._top_k.index_copy_(0, at, k[2 * n : 3 * n])
        self._seed.index_copy_(0, at, k[3 * n : 4 * n])
        self._min_tokens.index_copy_(0, at, k[4 * n : 5 * n])
        self._generated.index_fill_(0, at, 0)
        self._stops.index_copy_(0, at, k[5 * n : tail].view(n, S))
        if self._counts is not None:
            self._counts.index_fill_(0, at, 0.0)
        if self._prompt_seen is not None and rep_rows:
            self._prompt_seen.index_fill_(0, k[tail : tail + len(rep_at)], False)
            self._prompt_seen.view(-1).index_fill_(0, k[tail + len(rep_at) :], True)

    def release_rows(self, rows: list[int]) -> None:
        """Host bookkeeping only: a reused row's device settings are overwritten by add_rows."""
        known = [r for r in rows if 0 <= r < self.capacity]
        self._live[torch.tensor(known, dtype=torch.int64)] = False

    def _grow(self, rows: int, stops: int) -> None:
        """Reallocate for ``rows`` rows and stop lists of ``stops`` ids, keeping live rows."""
        if rows <= self.capacity and stops <= self._stops.shape[1]:
            return
        R = max(rows, 2 * self.capacity) if rows > self.capacity else self.capacity
        S = max(stops, self._stops.shape[1])
        for name in (
            "_temp",
            "_min_p",
            "_top_p",
            "_rep",
            "_pres",
            "_freq",
            "_greedy",
            "_top_k",
            "_seed",
            "_min_tokens",
            "_generated",
            "_counts",
            "_prompt_seen",
        ):
            old = getattr(self, name)
            if old is not None:
                new = old.new_zeros((R, *old.shape[1:]))
                new[: old.shape[0]] = old
                setattr(self, name, new)
        old_stops = self._stops
        self._stops = old_stops.new_full((R, S), self.vocab_size)
        self._stops[: old_stops.shape[0], : old_stops.shape[1]] = old_stops
        for name in (
            "_live",
            "_h_greedy",
            "_h_penalised",
            "_h_rep",
            "_h_min_p",
            "_h_top_k",
            "_h_top_p",
            "_h_banning",
            "_h_min_tokens",
            "_h_generated",
            "_h_logprobs",
        ):
            old_h = getattr(self, name)
            new_h = old_h.new_zeros(R)
            new_h[: len(old_h)] = old_h
            setattr(self, name, new_h)
        self.capacity = R

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            # Pinned, so the copy is queued on the stream instead of waiting for it.
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)
