"""The host's side of launched steps: their tokens taken into the host rows, in launch order.

A step's tokens reach the host after it ran; a verify step's counts come with them (the
device decided them). ``Recorder.through`` takes every launched step up to one into the
host rows: a verify step's counts settle the rows' counts of tokens (``RowState.settle``),
each row's emitted tokens join its history, and the sampler's host count of outputs catches
up. It runs from the completer thread (``finish``) and from a launch that needs tokens on
the host; it waits for a step's copy with nothing locked, so a launch is never held behind
a copy it does not need. The lock guards the host rows against the two threads: a launch
takes it while it changes or reads them (plan, layout, growth).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from streams.pipeline.device_rows import DeviceRows
from streams.pipeline.slots import Pending
from streams.rows import StepLayout
from streams.verify import keep_emitted


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._unrecorded: list[Pending] = []  # launched, tokens not yet in the host rows

    def reset(self) -> None:
        """Fresh row state: nothing launched on it yet."""
        self._unrecorded = []

    def launched(self, pending: Pending) -> None:
        with self.lock:
            self._unrecorded.append(pending)

    def last(self) -> Pending | None:
        """The latest launched step not yet recorded."""
        with self.lock:
            return self._unrecorded[-1] if self._unrecorded else None

    def through(self, pending: Pending, rows: DeviceRows) -> None:
        """Record every step up to ``pending`` into ``rows``, in order, each once its tokens
        are on the host."""
        while True:
            with self.lock:
                if not self._unrecorded or self._unrecorded[0].step_id > pending.step_id:
                    return
                step = self._unrecorded[0]
            step.copied.synchronize()
            with self.lock:
                if self._unrecorded and self._unrecorded[0] is step:
                    self._unrecorded.pop(0)
                    _record(step, rows)


def _record(step: Pending, rows: DeviceRows) -> None:
    """A step's tokens into the host rows; a verify step's counts settle them. Rows that took
    another request since the step launched are left alone."""
    layout, host = step.layout, rows.host
    tokens = step.slot.tokens[: step.num_tokens].numpy()
    if step.counts is None:
        step.counts = step.slot.counts[: len(layout.drafted)].numpy().astype(np.int32)
        host.settle(layout, step.counts, step.joined)
        kept = kept_positions(layout, step.counts)
        runs = layout.num_sampled[layout.num_sampled > 0]
        held = np.repeat(host.joins[layout.rows[layout.num_sampled > 0]] == step.joined, runs)
        outputs = np.ascontiguousarray(layout.sample_rows[kept & held], np.int64)
        rows.sampler.record_host(torch.from_numpy(outputs))
        tokens = tokens[kept]
    elif layout.verifying:
        tokens = tokens[kept_positions(layout, step.counts)]
    host.remember(layout, step.counts, tokens, step.joined)


def emitted(pending: Pending) -> tuple:
    """A recorded step's result parts, from its slot: the emitted tokens, their logprobs and
    top logprobs (None where none was asked), and a verify step's drafts per sampled row."""
    slot, count, layout = pending.slot, pending.num_tokens, pending.layout
    tokens = slot.tokens[:count].numpy().copy()
    logprobs = top = drafted = None
    if pending.has_logprobs:
        logprobs = slot.logprobs[:count].tolist()
        top = slot.top_lists(count, pending.top, pending.wanted)
    if layout.verifying:
        drafted = slot.drafted[: len(layout.drafted)].numpy().astype(np.int32)
        kept = kept_positions(layout, pending.counts)
        tokens = tokens[kept]
        if logprobs is not None:
            picked = np.flatnonzero(kept).tolist()
            logprobs, top = [logprobs[i] for i in picked], [top[i] for i in picked]
    return tokens, logprobs, top, drafted


def kept_positions(layout: StepLayout, counts: np.ndarray) -> np.ndarray:
    """bool [sampled positions]: those whose tokens their rows emitted."""
    nsampled = layout.num_sampled[layout.num_sampled > 0]
    return keep_emitted(layout.sample_offsets, nsampled, counts)
