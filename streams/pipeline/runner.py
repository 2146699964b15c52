"""The model runner: it launches step N+1 while step N runs, and never waits on the device to
do so. It is the runner on every model device: CUDA through streams and events, a CPU through
``devsync``'s serialised host twin (where a launch does the step's work at once).

``launch(plan)`` applies the plan to the row state, lays the step out (starts resolved,
drafts filled), packs its flat arrays into a pinned slot, copies them on the H2D stream and
enqueues the forward and the sampler on the compute stream; the sampled tokens go to the
host on the D2H stream. It returns a ``Pending`` at once. ``finish(pending)`` waits for that
step's copy and builds its ``StepResult``; the device process calls it from a completer
thread, in launch order.

Why it needs no host round trip between steps: step N's tokens are written to a device token
buffer on the compute stream, and step N+1's PLACEHOLDER inputs are filled from it later on
the same stream. Every change to persistent state (block tables, token buffer, sampling rows,
KV cache) is issued on the compute stream, so a row released and reused by plan N+1 cannot
change what step N, still running, reads. A slot (pinned input, device staging, pinned
output) is reused only after the step that used it was finished, which bounds the pipeline
to ``SLOTS`` steps in flight and makes every staging area safe to overwrite.

Speculation keeps the overlap (``streams.pipeline.speculation``): a verify step's emitted
counts are decided on the device, a later step starts its rows where the device's counts
end, and the n-gram drafter drafts on the device from the rows' tokens there, so neither
waits for a token on the host; the suffix drafter drafts ahead on the host, over the steps
in flight, and the device keeps the drafts that follow its rows' tokens
(``streams.drafting.ahead``). The host learns the counts with the tokens. What still waits
for tokens on the host (only those lose the overlap): steps with structured-output rows (a
row's mask depends on its last token), the draft model's drafts (made on the host from
every row's tokens, so such a step first waits for every step before it), and, where the
host plans attention (torch's, not Triton's), a step whose rows' counts the host does not
know yet.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sampler.prompt_logprobs import score_positions
from sampler.sampler import Positions
from streams import cuda_kernels
from streams.device import REPLAY_STEP, DeviceError
from streams.drafting.ahead import ChainsOnDevice
from streams.drafting.base import Drafter
from streams.grammar import TokenizerSource
from streams.pipeline import devsync
from streams.pipeline.clock import EventClock
from streams.pipeline.device_rows import TOKEN_WINDOW, DeviceRows, token_slots
from streams.pipeline.forward import StepForward
from streams.pipeline.memory import kv_blocks_for
from streams.pipeline.recording import Recorder, emitted, kept_positions
from streams.pipeline.slots import (
    Pending,
    Slot,
    fit_slot,
    new_slot,
    packed_length,
    step_sections,
)
from streams.pipeline.speculation import draft, resolve_starts, verify
from streams.plan import RESOLVE, PromptLogprobs, StepPlan, StepResult
from streams.rows import StepLayout

SLOTS = 2  # steps in flight: N running while N+1 is queued behind it


class PipelinedRunner:
    def __init__(
        self,
        model: Any,
        num_blocks: int | None,
        block_size: int,
        max_blocks_per_row: int,
        device: torch.device | str = "cpu",
        tokenizer: TokenizerSource | None = None,
        cuda_graphs: bool = True,
        graph_max_batch: int = 80,
        attention: str = "auto",  # auto | triton | torch: who attends (triton on CPU: tests)
        seed: int | None = None,
        memory_share: float = 0.9,  # with num_blocks None: gpu_memory_utilization
        step_tokens: int = 512,  # the largest step, for the memory probe
        drafter: Drafter | None = None,  # proposes the drafts of rows that verify drafts
        eager_buckets: bool = False,  # padded decode buckets without capture (tests, a CPU)
        graph_tokens_per_row: int = 1,  # verify buckets' tokens a row: 1 + drafts (1: none)
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.sync = devsync.for_device(self.device)
        self.block_size, self.max_blocks_per_row = block_size, max_blocks_per_row
        self.vocab_size = model.cfg.vocab_size
        self.tokenizer, self.seed = tokenizer, seed
        self.drafter = drafter
        if attention not in ("auto", "triton", "torch"):
            raise ValueError(f"attention must be auto|triton|torch, got {attention!r}")
        if attention == "auto":
            attention = "triton" if model.triton_attention_runs(block_size) else "torch"
        if num_blocks is None:
            if self.device.type != "cuda":
                raise ValueError("num_blocks is needed off CUDA (memory sizing reads the GPU)")
            num_blocks = kv_blocks_for(model, block_size, memory_share, step_tokens)
        # One block more than the pool: padding rows of a graph bucket read and write it.
        self.num_blocks = num_blocks
        self.info = {"num_blocks": num_blocks}  # told to the control plane at start
        self.kv_cache = model.allocate_kv_cache(num_blocks + 1, block_size)
        self.compute, self.h2d, self.d2h = (self.sync.stream() for _ in range(3))
        self.recorder = Recorder()  # launched steps' tokens into the host rows, in order
        self.rows = self._fresh_rows()
        self._free: queue.Queue[Slot] = queue.Queue()
        for _ in range(SLOTS):
            self._free.put(new_slot(self.sync, self.device, 1024, 64))
        self.forward = StepForward(model, self.kv_cache, attention == "triton")
        # Torch's attention is planned on the host, from every row's exact count of tokens.
        self.host_plans_attention = attention != "triton"
        # Padded decode buckets pay only where a graph is captured: on a CPU they would
        # compute the padding rows for nothing (tests run them there eagerly).
        if cuda_graphs and (self.sync.graph_capable or eager_buckets):
            self.forward.use_graphs(
                self.sync,
                self.compute,
                graph_max_batch,
                max_blocks_per_row,
                num_blocks,
                block_size,
                self.device,
                graph_tokens_per_row,
            )
        self.sync.synchronize()  # the cache and buffers written above, before the compute stream
        with self.sync.use(self.compute):
            self.forward.warm(num_blocks, block_size, self.device)
        self.clock = EventClock(self.sync)
        self.clock.anchor(self.compute)
        self._state_applied = True  # whether the launching step's plan reached the device rows

    # ------------------------------------------------------------------ steps
    def launch(self, plan: StepPlan, arrived_at: float | None = None) -> Pending | StepResult:
        """Enqueue a step; returns a Pending (or, for a step that failed or had nothing to
        run, its StepResult at once). Blocks only while SLOTS steps are unfinished."""
        start = time.monotonic()
        try:
            return self._launch(plan)
        except DeviceError:
            raise
        except Exception as exc:  # the step fails alone; the device keeps serving
            _raise_if_device_lost(exc)
            return StepResult(
                plan.step_id,
                [],
                device_start=start,
                device_end=time.monotonic(),
                error=f"{type(exc).__name__}: {exc}",
            )

    def finish(self, pending: Pending | StepResult) -> StepResult:
        """Wait for a launched step's tokens to reach the host; its result."""
        if isinstance(pending, StepResult):
            return pending
        try:
            pending.copied.synchronize()
            self.recorder.through(pending, self.rows)  # a verify step's counts known from here
            tokens, logprobs, top, drafted = emitted(pending)
            start = self.clock.to_host(pending.start)
            end = self.clock.to_host(pending.end, advance=True)
        except Exception as exc:
            _raise_if_device_lost(exc)
            raise
        finally:
            self._free.put(pending.slot)
        result = StepResult(pending.step_id, tokens, logprobs, top, start, end)
        if pending.scores is not None:
            result.prompt_logprobs = prompt_logprobs(pending.layout, pending.scores)
        if drafted is not None:
            result.counts, result.drafted = pending.counts, drafted
        return result

    def replay(self, plans: list[StepPlan]) -> StepResult:
        """The plans back to back, pipelined, on row state of their own (the roofline)."""
        live = self.rows
        self.rows = self._fresh_rows()
        self.sync.synchronize()  # its zeroed tensors exist before the compute stream reads them
        try:
            window: list[Pending | StepResult] = []
            first = last = None
            for plan in plans:
                if len(window) == SLOTS:
                    last = self.finish(window.pop(0))
                    first = first or last
                window.append(self.launch(plan))
            for pending in window:
                last = self.finish(pending)
                first = first or last
            if first is None:
                now = time.monotonic()
                return StepResult(REPLAY_STEP, [], None, None, now, now)
            return StepResult(REPLAY_STEP, [], None, None, first.device_start, last.device_end)
        finally:
            self.rows = live

    # --------------------------------------------------------------- internals
    @torch.inference_mode()
    def _launch(self, plan: StepPlan) -> Pending | StepResult:
        rows = self.rows
        if self._free.qsize() == SLOTS and self.clock.anchor_due():  # idle: nothing in flight
            self.clock.anchor(self.compute)
        with self.recorder.lock:
            delta = rows.apply(plan, self.drafter)
        # Drafting on the device spares the host a wait for earlier tokens, at a price: its
        # drafts are of fixed length, found or not. Where the tokens are here anyway (a
        # serial device, a CPU) or the step waits for them all the same, drafts made here
        # are as long as each row's match and rows without one verify nothing.
        resolve_waits = self._resolve_waits(plan)
        on_device = not (self.sync.serial or resolve_waits) and self._drafts_on_device(plan)
        drafts_here = bool((plan.num_sampled > 1).any()) and not on_device
        last = self.recorder.last()
        if last is not None and (resolve_waits or drafts_here):
            self.recorder.through(last, rows)
        with self.recorder.lock:
            layout = rows.host.layout(plan, self.drafter, on_device)
        if not len(plan.rows):
            with self.sync.use(self.compute):
                rows.join(plan)
            now = time.monotonic()
            return StepResult(plan.step_id, np.zeros(0, np.int64), device_start=now, device_end=now)
        sections = step_sections(layout, delta, token_slots)
        slot = self._free.get()
        try:
            return self._enqueue(plan, layout, slot, sections)
        except BaseException as exc:
            # Work of the step may be queued still, reading the slot's buffers: they are
            # free again only once the device has done it.
            self.sync.synchronize()
            self._free.put(slot)
            if not isinstance(exc, DeviceError) and not self._state_applied:
                raise DeviceError(
                    f"a step failed before the device's row state took its plan ({exc!r}): "
                    "the device's rows are no longer the host's"
                ) from exc
            raise

    def _enqueue(
        self, plan: StepPlan, layout: StepLayout, slot: Slot, sections: dict[str, np.ndarray]
    ) -> Pending:
        sync, rows = self.sync, self.rows
        self._state_applied = False
        total = packed_length(sections)
        slot = fit_slot(sync, self.device, slot, total, len(layout.sample_rows))
        offsets = slot.pack(sections)
        staged = sync.event()
        with sync.use(self.h2d):
            slot.dev_in[:total].copy_(slot.host_in[:total], non_blocking=True)
            staged.record()
        start, end, copied = (
            sync.event(timing=True),
            sync.event(timing=True),
            sync.event(blocking=True),
        )
        runs = int((layout.num_sampled > 0).sum())
        counts = None if layout.verifying else np.ones(runs, np.int32)
        sampled = len(layout.sample_rows)
        with sync.step_range(f"step {plan.step_id}"), sync.use(self.compute):
            self.compute.wait_event(staged)
            start.record()
            dev = {name: slot.dev_in[a:b] for name, (a, b) in offsets.items()}
            rows.join(plan)
            rows.fit()
            if len(dev["delta_rows"]):
                rows.tables.index_put_((dev["delta_rows"], dev["delta_cols"]), dev["delta_blocks"])
            # From here a failure fails the step alone: the device's rows took the plan, as
            # the host's did (``rows.apply``), so the two agree whatever the forward does.
            self._state_applied = True
            own = rows.row_tokens
            width = self._width(layout)
            if own is not None:
                own.widen(width)
            if layout.resolve_on_device is not None:
                resolve_starts(dev, own, rows.tables, self.block_size, TOKEN_WINDOW, sampled)
            drafted = None
            if layout.verifying:
                drafted = dev["drafted"]
                if layout.drafts_on_device:
                    most = int(layout.num_sampled.max()) - 1
                    drafter = self.drafter
                    if layout.chains is not None:
                        drafter = _chains(dev, getattr(drafter, "missed", None))
                    drafted = draft(dev, own, drafter, most, width)
            cuda_kernels.fill_placeholders(dev["input_ids"], dev["token_slots"], rows.tokens)
            logits = self.forward(layout, dev, rows)
            scores = None
            if layout.scores is not None:  # rows asking for prompt logprobs: after the sampled
                scored = logits[sampled:]
                logits = logits[:sampled]
                top = int(layout.scores.top.max())
                scores = score_positions(scored, dev["score_targets"], top)
            keep: tuple = ()
            wanted: list[int | None] = []
            if sampled:
                sample = rows.sample(logits, _positions(layout, dev), layout)
                tokens, wanted = sample.tokens, sample.wanted
                cuda_kernels.scatter_tokens(rows.tokens, dev["sample_slots"], tokens)
                emitted = None
                host_rows = _host(layout.sample_rows)
                if layout.verifying:
                    emitted, kept = verify(dev, layout, tokens, drafted)
                    rows.sampler.record(host_rows, dev["sample_rows"], tokens, kept)
                    if rows.constrained(layout.sample_rows):
                        counts = self._advance_grammars(layout, tokens, emitted)
                else:
                    rows.sampler.record(host_rows, dev["sample_rows"], tokens)
                if own is not None:
                    at = dev["positions"].index_select(0, dev["logits_indices"][:sampled])
                    ones = torch.ones_like(dev["run_rows"])
                    own.record(dev["sample_rows"], at, tokens, dev["run_rows"],
                               ones if emitted is None else emitted)  # fmt: skip
                keep = (tokens, sample.logprobs, sample.top_ids, sample.top_logprobs, emitted,
                        drafted)  # fmt: skip
            end.record()
        with self.recorder.lock:
            rows.host.grow(layout, counts)
            joined = rows.host.joined(layout)
        with sync.use(self.d2h):
            self.d2h.wait_event(end)
            top = _copy_out(slot, keep, sampled)
            copied.record()
        has_logprobs = bool(keep) and keep[1] is not None
        pending = Pending(
            plan.step_id, slot, sampled, top, wanted, has_logprobs, start, end, copied, keep,
            layout, counts, joined, scores,
        )  # fmt: skip
        self.recorder.launched(pending)
        if sync.serial:
            self.recorder.through(pending, rows)
        return pending

    def _drafts_on_device(self, plan: StepPlan) -> bool:
        """Whether the step's drafts are made on the device: by a drafter that can, or kept
        there from chains a drafter drafted ahead on the host, for rows without a grammar
        (whose masks need the drafts on the host)."""
        slots = plan.num_sampled > 1
        drafter = self.drafter
        if not slots.any() or not (
            getattr(drafter, "drafts_on_device", False) or getattr(drafter, "drafts_ahead", False)
        ):
            return False
        return not self.rows.constrained(plan.rows[slots].astype(np.int64))

    def _resolve_waits(self, plan: StepPlan) -> bool:
        """Whether the step needs earlier steps' counts on the host: attention planned here
        needs every row's length, and a verify step leaves its rows' lengths to the device."""
        if not self.host_plans_attention:
            return False
        with self.recorder.lock:
            resolve = plan.rows[plan.starts == RESOLVE].astype(np.int64)
            return bool((self.rows.host.unsettled[resolve] > 0).any())

    def _width(self, layout: StepLayout) -> int:
        """Tokens a row of the step can hold after it, at most: its blocks' positions."""
        blocks = self.rows.host.num_blocks[layout.rows]
        return int(blocks.max()) * self.block_size + 1 if len(blocks) else 1

    def _advance_grammars(
        self, layout: StepLayout, tokens: torch.Tensor, emitted: torch.Tensor
    ) -> np.ndarray:
        """A verify step with a structured-output row: its matchers take the emitted tokens
        now (the step waits for them), so its counts are known at once."""
        counts = emitted.cpu().numpy().astype(np.int32)
        kept = kept_positions(layout, counts)
        self.rows.advance_grammars(layout.sample_rows[kept], tokens.cpu().numpy()[kept].tolist())
        self.rows.sampler.record_host(_host(layout.sample_rows[kept]))
        return counts

    def _fresh_rows(self) -> DeviceRows:
        """Row state whose device tensors belong to the compute stream (allocated there):
        the one stream that writes and reads them, so one that is regrown or dropped is freed
        in order with the steps that still read it."""
        self.recorder.reset()
        with self.sync.use(self.compute):
            return self._new_rows()

    def _new_rows(self) -> DeviceRows:
        return DeviceRows(
            self.block_size,
            self.max_blocks_per_row,
            self.vocab_size,
            self.device,
            self.seed,
            self.tokenizer,
            speculative=self.drafter is not None,
        )


def prompt_logprobs(layout: StepLayout, scores: tuple) -> list[PromptLogprobs]:
    """The step's scored prompt positions, by row: (row, first position, logprobs, ranks,
    top-n per position). Read after the step's copy event: the scores are computed."""
    chosen, rank, top_ids, top_values = (t.cpu() for t in scores)
    at = layout.scores
    out: list[PromptLogprobs] = []
    starts = np.flatnonzero(np.r_[True, at.rows[1:] != at.rows[:-1]]).tolist()
    for a, b in zip(starts, [*starts[1:], len(at.rows)], strict=True):
        k = int(at.top[a])
        ids, values = top_ids[a:b, :k].tolist(), top_values[a:b, :k].tolist()
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        out.append(
            (int(at.rows[a]), int(at.positions[a]), chosen[a:b].tolist(), rank[a:b].tolist(), tops)
        )
    return out


def _chains(dev: dict[str, torch.Tensor], missed: object | None) -> ChainsOnDevice:
    """The chains a host drafter drafted ahead, as the step's copy holds them (``missed``:
    the drafter's device drafter for rows whose chains missed)."""
    base = dev["chain_base"]
    tokens = dev["chain_tokens"].view(len(base), -1)
    return ChainsOnDevice(tokens, dev["chain_lengths"], base, missed)


def _host(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, np.int64))


def _positions(layout: StepLayout, dev: dict[str, torch.Tensor]) -> Positions:
    at = Positions(_host(layout.sample_rows), dev["sample_rows"])
    if layout.verifying:
        at.offsets, at.offsets_dev = _host(layout.sample_offsets), dev["sample_offsets"]
        if len(dev["drafts_at"]):
            at.drafts_before = (dev["drafts_at"], dev["input_ids"][dev["drafts_input"]])
    return at


def _copy_out(slot: Slot, keep: tuple, count: int) -> int:
    """The sampled tokens (with logprobs, and a verify step's counts) into the pinned
    output; the top logprobs' width."""
    if not count:
        return 0
    tokens, logprobs, top_ids, top_values, counts, drafted = keep
    slot.tokens[:count].copy_(tokens, non_blocking=True)
    if counts is not None:
        slot.counts[: len(counts)].copy_(counts, non_blocking=True)
        slot.drafted[: len(drafted)].copy_(drafted, non_blocking=True)
    if logprobs is not None:
        slot.logprobs[:count].copy_(logprobs, non_blocking=True)
    top = 0 if top_ids is None else top_ids.shape[1]
    if top:
        slot.top_ids[: count * top].copy_(top_ids.reshape(-1), non_blocking=True)
        slot.top_values[: count * top].copy_(top_values.reshape(-1), non_blocking=True)
    return top


# How torch, cuBLAS, Triton and CuPy (driver and runtime API) word a CUDA failure; an
# out-of-memory one leaves the context usable.
CONTEXT_LOST = ("CUDA error", "CUBLAS_STATUS", "Triton Error [CUDA]", "CUDA_ERROR_", "cudaError")
OUT_OF_MEMORY = ("out of memory", "CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation")


def _raise_if_device_lost(exc: BaseException) -> None:
    """A CUDA error other than out-of-memory leaves the context unusable: the device as a
    whole has failed, and its supervisor replaces the process."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and any(mark in text for mark in CONTEXT_LOST):
        if not any(mark in text for mark in OUT_OF_MEMORY):
            raise DeviceError(f"the CUDA context is lost: {text}") from exc


def build_pipelined_runner(
    model_factory: Any,
    num_blocks: int | None,
    block_size: int,
    max_blocks_per_row: int,
    device: str = "cuda",
    tokenizer: TokenizerSource | None = None,
    cuda_graphs: bool = True,
    graph_max_batch: int = 80,
    memory_share: float = 0.9,
    step_tokens: int = 512,
    drafter: Callable[[], Drafter] | None = None,
    graph_tokens_per_row: int = 1,
) -> PipelinedRunner:
    """Module level, so a device process can receive it by name inside a partial (with the
    drafter's factory: the drafter is built in the device process)."""
    return PipelinedRunner(
        model_factory(),
        num_blocks,
        block_size,
        max_blocks_per_row,
        device,
        tokenizer,
        cuda_graphs,
        graph_max_batch,
        memory_share=memory_share,
        step_tokens=step_tokens,
        drafter=None if drafter is None else drafter(),
        graph_tokens_per_row=graph_tokens_per_row,
    )
