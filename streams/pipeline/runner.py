"""A runner that launches step N+1 while step N runs, and never waits on the device to do so.

``launch(plan)`` applies the plan to the row state, packs the step's flat arrays into a pinned
slot, copies them on the H2D stream and enqueues the forward and the sampler on the compute
stream; the sampled tokens go to the host on the D2H stream. It returns a ``Pending`` at once.
``finish(pending)`` waits for that step's copy and builds its ``StepResult``; the device
process calls it from a completer thread, in launch order.

Why it needs no host round trip between steps: step N's tokens are written to a device token
buffer on the compute stream, and step N+1's PLACEHOLDER inputs are filled from it later on
the same stream. Every change to persistent state (block tables, token buffer, sampling rows,
KV cache) is issued on the compute stream, so a row released and reused by plan N+1 cannot
change what step N, still running, reads. A slot (pinned input, device staging, pinned
output) is reused only after the step that used it was finished, which bounds the pipeline
to ``SLOTS`` steps in flight and makes every staging area safe to overwrite.

Steps with structured-output rows are the exception: a row's mask depends on its previous
token, so such a step waits for its own tokens on the host before it returns (only that step
loses the overlap). Through ``devsync`` the same code runs on CPU tensors, serialised.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import numpy as np
import torch

from streams import cuda_kernels
from streams.device import REPLAY_STEP, DeviceError
from streams.pipeline import devsync
from streams.pipeline.clock import EventClock
from streams.pipeline.device_rows import DeviceRows
from streams.pipeline.forward import StepForward
from streams.pipeline.memory import kv_blocks_for
from streams.pipeline.slots import Pending, Slot, fit_slot, new_slot, step_sections
from streams.plan import StepPlan, StepResult

SLOTS = 2  # steps in flight: N running while N+1 is queued behind it


class PipelinedRunner:
    def __init__(
        self,
        model: Any,
        num_blocks: int | None,
        block_size: int,
        max_blocks_per_row: int,
        device: torch.device | str = "cpu",
        tokenizer_folder: str | None = None,
        cuda_graphs: bool = True,
        graph_max_batch: int = 80,
        attention: str = "auto",  # auto | triton | torch: who attends (triton on CPU: tests)
        seed: int | None = None,
        memory_share: float = 0.9,  # with num_blocks None: gpu_memory_utilization
        step_tokens: int = 512,  # the largest step, for the memory probe
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.sync = devsync.for_device(self.device)
        self.block_size, self.max_blocks_per_row = block_size, max_blocks_per_row
        self.vocab_size = model.cfg.vocab_size
        self.tokenizer_folder, self.seed = tokenizer_folder, seed
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
        self.rows = self._fresh_rows()
        self._free: queue.Queue[Slot] = queue.Queue()
        for _ in range(SLOTS):
            self._free.put(new_slot(self.sync, self.device, 1024, 64))
        self.forward = StepForward(model, self.kv_cache, attention == "triton")
        if cuda_graphs:
            self.forward.use_graphs(
                self.sync,
                self.compute,
                graph_max_batch,
                max_blocks_per_row,
                num_blocks,
                block_size,
                self.device,
            )
        self.sync.synchronize()
        self.clock = EventClock(self.sync)
        self.clock.anchor(self.compute)

    # ------------------------------------------------------------------ steps
    def launch(self, plan: StepPlan) -> Pending | StepResult:
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
            slot, count = pending.slot, pending.num_sampled
            tokens = slot.tokens[:count].numpy().copy()
            logprobs = top = None
            if pending.has_logprobs:
                logprobs = slot.logprobs[:count].tolist()
                top = slot.top_lists(count, pending.top, pending.wanted)
            start, end = self.clock.to_host(pending.start), self.clock.to_host(pending.end)
        except Exception as exc:
            _raise_if_device_lost(exc)
            raise
        finally:
            self._free.put(pending.slot)
        return StepResult(pending.step_id, tokens, logprobs, top, start, end)

    def run(self, plan: StepPlan) -> StepResult:
        """One step, synchronously (the Runner protocol)."""
        return self.finish(self.launch(plan))

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
        delta = rows.apply(plan)
        if not len(plan.rows):
            with self.sync.use(self.compute):
                rows.join(plan)
            now = time.monotonic()
            return StepResult(plan.step_id, np.zeros(0, np.int64), device_start=now, device_end=now)
        layout = rows.host.layout(plan)
        sampled_rows = plan.rows[plan.sample].astype(np.int64)
        sections = step_sections(plan, layout, sampled_rows, delta)
        slot = self._free.get()
        try:
            return self._enqueue(plan, slot, sections, layout.context_lens, sampled_rows)
        except BaseException:
            self._free.put(slot)
            raise

    def _enqueue(
        self,
        plan: StepPlan,
        slot: Slot,
        sections: dict[str, np.ndarray],
        context_lens: np.ndarray,
        sampled_rows: np.ndarray,
    ) -> Pending:
        sync, rows = self.sync, self.rows
        total = sum(len(a) for a in sections.values())
        slot = fit_slot(sync, self.device, slot, total, len(sampled_rows))
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
        with sync.step_range(f"step {plan.step_id}"), sync.use(self.compute):
            self.compute.wait_event(staged)
            start.record()
            dev = {name: slot.dev_in[a:b] for name, (a, b) in offsets.items()}
            rows.join(plan)
            rows.fit()
            if len(dev["delta_rows"]):
                rows.tables.index_put_((dev["delta_rows"], dev["delta_cols"]), dev["delta_blocks"])
            ids = dev["input_ids"]
            cuda_kernels.fill_placeholders(ids, dev["token_rows"], rows.tokens)
            logits = self.forward(plan, dev, context_lens, rows)
            keep: tuple = ()
            has_logprobs, top, wanted = False, 0, []
            if len(sampled_rows):
                sample, tokens = rows.sample(logits, sampled_rows, dev["sampled_rows"])
                cuda_kernels.scatter_tokens(rows.tokens, dev["sampled_rows"], tokens)
                has_logprobs = sample.logprobs is not None
                top = 0 if sample.top_ids is None else sample.top_ids.shape[1]
                wanted = sample.wanted
                keep = (tokens, sample.logprobs, sample.top_ids, sample.top_logprobs)
            end.record()
        with sync.use(self.d2h):
            self.d2h.wait_event(end)
            count = len(sampled_rows)
            if count:
                slot.tokens[:count].copy_(keep[0], non_blocking=True)
                if has_logprobs:
                    slot.logprobs[:count].copy_(keep[1], non_blocking=True)
                if top:
                    slot.top_ids[: count * top].copy_(keep[2].reshape(-1), non_blocking=True)
                    slot.top_values[: count * top].copy_(keep[3].reshape(-1), non_blocking=True)
            copied.record()
        return Pending(
            plan.step_id, slot, count, top, wanted, has_logprobs, start, end, copied, keep
        )

    def _fresh_rows(self) -> DeviceRows:
        return DeviceRows(
            self.block_size,
            self.max_blocks_per_row,
            self.vocab_size,
            self.device,
            self.seed,
            self.tokenizer_folder,
        )


def _raise_if_device_lost(exc: BaseException) -> None:
    """A CUDA error other than out-of-memory leaves the context unusable: the device as a
    whole has failed, and its supervisor replaces the process."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and ("CUDA error" in text or "CUBLAS_STATUS" in text):
        if "out of memory" not in text:
            raise DeviceError(f"the CUDA context is lost: {text}") from exc


def build_pipelined_runner(
    model_factory: Any,
    num_blocks: int | None,
    block_size: int,
    max_blocks_per_row: int,
    device: str = "cuda",
    tokenizer_folder: str | None = None,
    cuda_graphs: bool = True,
    graph_max_batch: int = 80,
    memory_share: float = 0.9,
    step_tokens: int = 512,
) -> PipelinedRunner:
    """Module level, so a device process can receive it by name inside a partial."""
    return PipelinedRunner(
        model_factory(),
        num_blocks,
        block_size,
        max_blocks_per_row,
        device,
        tokenizer_folder,
        cuda_graphs,
        graph_max_batch,
        memory_share=memory_share,
        step_tokens=step_tokens,
    )
