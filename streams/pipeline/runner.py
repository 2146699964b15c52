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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sampler.device import DeviceSampler
from streams import cuda_kernels
from streams.batch import ForwardBatch
from streams.device import REPLAY_STEP, DeviceError
from streams.grammar import GrammarRows
from streams.pipeline import devsync
from streams.pipeline.clock import EventClock
from streams.pipeline.graphs import DecodeGraphs
from streams.pipeline.memory import kv_blocks_for
from streams.plan import StepPlan, StepResult
from streams.rows import RowState

SLOTS = 2  # steps in flight: N running while N+1 is queued behind it
MAX_TOP = 20  # top logprobs a row may ask for (sampler.params.MAX_LOGPROBS)
# The flat int64 arrays of one step, packed back to back into one pinned slot.
SECTIONS = ("input_ids", "token_rows", "positions", "kv_slots", "rows", "context_lens",
            "q_starts", "q_lens", "logits_indices", "sampled_rows", "delta_rows",
            "delta_cols", "delta_blocks")  # fmt: skip


@dataclass(slots=True)
class Slot:
    """Buffers of one step in flight; grown (never shrunk) while the slot is free."""

    host_in: torch.Tensor  # pinned int64: the packed sections
    dev_in: torch.Tensor  # the device's copy of it
    tokens: torch.Tensor  # pinned int64 [S]
    logprobs: torch.Tensor  # pinned float32 [S]
    top_ids: torch.Tensor  # pinned int64 [S * MAX_TOP]
    top_values: torch.Tensor  # pinned float32 [S * MAX_TOP]


@dataclass(slots=True)
class Pending:
    """A launched step: what ``finish`` needs to turn it into a StepResult."""

    step_id: int
    slot: Slot
    num_sampled: int
    top: int  # top logprobs copied per row
    wanted: list[int | None]  # each sampled row's own logprobs setting
    has_logprobs: bool
    start: Any  # events: compute began the step, sampling ended, tokens reached the host
    end: Any
    copied: Any
    keep: tuple  # device tensors the D2H copy reads: alive until it is done


class DeviceRows:
    """Row state of one pipeline: host tables (for the layout), device tables, token buffer,
    sampling rows and grammar matchers. ``replay`` swaps in a fresh one."""

    def __init__(self, runner: PipelinedRunner) -> None:
        device = runner.device
        self.host = RowState(runner.block_size, runner.max_blocks_per_row)
        rows = len(self.host.live)
        self.tables = torch.zeros(rows, runner.max_blocks_per_row, dtype=torch.int64,
                                  device=device)  # fmt: skip
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampler = DeviceSampler(runner.vocab_size, device, rows, runner.seed)
        self.grammars = GrammarRows(runner.tokenizer_folder, runner.vocab_size)

    def fit(self) -> None:
        """Grow the device tables to the host's rows (called on the compute stream)."""
        rows = len(self.host.live)
        have = self.tables.shape[0]
        if rows > have:
            self.tables = torch.cat(
                [self.tables, self.tables.new_zeros(rows - have, self.tables.shape[1])]
            )
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(rows - have)])


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
        self.triton = attention == "triton"
        if num_blocks is None:
            if self.device.type != "cuda":
                raise ValueError("num_blocks is needed off CUDA (memory sizing reads the GPU)")
            num_blocks = kv_blocks_for(model, block_size, memory_share, step_tokens)
        # One block more than the pool: padding rows of a graph bucket read and write it.
        self.num_blocks = num_blocks
        self.info = {"num_blocks": num_blocks}  # told to the control plane at start
        self.kv_cache = model.allocate_kv_cache(num_blocks + 1, block_size)
        self.compute, self.h2d, self.d2h = (self.sync.stream() for _ in range(3))
        self.rows = DeviceRows(self)
        self._free: queue.Queue[Slot] = queue.Queue()
        for _ in range(SLOTS):
            self._free.put(self._new_slot(1024, 64))
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(model, self.kv_cache, graph_max_batch, max_blocks_per_row,
                                       num_blocks, block_size, self.device,
                                       self._triton_decode if self.triton else None)  # fmt: skip
            if self.sync.graph_capable:
                if not self.triton:
                    self.graphs = None  # the torch attention path plans on the host
                else:
                    self.graphs.capture(self.sync, self.compute)
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
            return StepResult(plan.step_id, [], device_start=start, device_end=time.monotonic(),
                              error=f"{type(exc).__name__}: {exc}")  # fmt: skip

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
                top = _top_lists(slot, count, pending.top, pending.wanted)
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
        self.rows = DeviceRows(self)
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
        released = plan.released_rows.tolist()
        for row in released:
            rows.grammars.drop(row)
        rows.sampler.release_rows(released)
        for new in plan.new_rows:
            rows.grammars.add(new.row, new.params.structured_output)
        delta = rows.host.apply(plan)
        if not len(plan.rows):
            with self.sync.use(self.compute):
                self._join_rows(plan)
            now = time.monotonic()
            return StepResult(plan.step_id, np.zeros(0, np.int64), device_start=now,
                              device_end=now)  # fmt: skip
        layout = rows.host.layout(plan)
        sampled_rows = plan.rows[plan.sample].astype(np.int64)
        sections = {
            "input_ids": plan.input_ids, "token_rows": layout.token_rows,
            "positions": layout.positions, "kv_slots": layout.kv_slots, "rows": plan.rows,
            "context_lens": layout.context_lens,
            "q_starts": np.cumsum(plan.query_lens) - plan.query_lens, "q_lens": plan.query_lens,
            "logits_indices": (np.cumsum(plan.query_lens) - 1)[plan.sample],
            "sampled_rows": sampled_rows, "delta_rows": delta[0], "delta_cols": delta[1],
            "delta_blocks": delta[2],
        }  # fmt: skip
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
        slot = self._fit(slot, total, len(sampled_rows))
        packed = slot.host_in.numpy()
        offsets, at = {}, 0
        for name in SECTIONS:
            values = sections[name]
            packed[at : at + len(values)] = values
            offsets[name] = (at, at + len(values))
            at += len(values)
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
            self._join_rows(plan)
            rows.fit()
            if len(dev["delta_rows"]):
                rows.tables.index_put_((dev["delta_rows"], dev["delta_cols"]), dev["delta_blocks"])
            ids = dev["input_ids"]
            cuda_kernels.fill_placeholders(ids, dev["token_rows"], rows.tokens)
            logits = self._forward(plan, dev, context_lens)
            keep: tuple = ()
            has_logprobs, top, wanted = False, 0, []
            if len(sampled_rows):
                sample, tokens = self._sample(logits, sampled_rows, dev["sampled_rows"])
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
        return Pending(plan.step_id, slot, count, top, wanted, has_logprobs, start, end, copied,
                       keep)  # fmt: skip

    def _join_rows(self, plan: StepPlan) -> None:
        if plan.new_rows:
            new = plan.new_rows
            self.rows.sampler.add_rows([n.row for n in new], [n.params for n in new],
                                       [n.prompt_ids for n in new], [n.stop_ids for n in new])  # fmt: skip

    def _forward(
        self, plan: StepPlan, dev: dict[str, torch.Tensor], context_lens: np.ndarray
    ) -> torch.Tensor:
        rows = self.rows
        context_host = context_lens.tolist()
        row_ids = dev["rows"]
        decode = bool((plan.query_lens == 1).all() and plan.sample.all())
        graphs = self.graphs
        if decode and graphs is not None and graphs.bucket(len(plan.rows)) is not None:
            return graphs.run(dev["input_ids"], dev["positions"], dev["kv_slots"],
                              dev["context_lens"], context_host, rows.tables,
                              row_ids)  # fmt: skip
        width = int(rows.host.num_blocks[plan.rows].max())
        tables = rows.tables[:, : max(width, 1)].index_select(0, row_ids)
        attention = None
        if self.triton:
            attention = self.model.device_attention(tables, dev["q_starts"], dev["q_lens"],
                                                    dev["context_lens"],
                                                    int(plan.query_lens.max()),
                                                    len(plan.input_ids))  # fmt: skip
        batch = ForwardBatch(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            slot_mapping=dev["kv_slots"],
            query_lens=plan.query_lens.tolist(),
            context_lens=context_host,
            block_tables=tables,
            logits_indices=dev["logits_indices"],
            attention=attention,
        )
        return self.model(batch, self.kv_cache)

    def _sample(
        self, logits: torch.Tensor, sampled_rows: np.ndarray, rows_dev: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        rows = self.rows
        row_list = sampled_rows.tolist()
        if not any(r in rows.grammars.matchers for r in row_list):
            sample = rows.sampler.sample(logits, sampled_rows, rows_dev)
            return sample, sample.tokens
        # A constrained row: its mask needs the matcher, which needs its last token on the
        # host. Earlier steps with this row were synchronous too, so the matcher is current.
        logits = logits.clone()
        picked = rows.grammars.constrain(logits, row_list)
        sample = rows.sampler.sample(logits, sampled_rows, rows_dev)
        rows.grammars.advance(row_list, picked, sample.tokens.tolist())
        return sample, sample.tokens

    def _new_slot(self, ints: int, sampled: int) -> Slot:
        pin = self.sync.pinned
        return Slot(
            host_in=pin(ints, torch.int64),
            dev_in=torch.zeros(ints, dtype=torch.int64, device=self.device),
            tokens=pin(sampled, torch.int64),
            logprobs=pin(sampled, torch.float32),
            top_ids=pin(sampled * MAX_TOP, torch.int64),
            top_values=pin(sampled * MAX_TOP, torch.float32),
        )

    def _fit(self, slot: Slot, ints: int, sampled: int) -> Slot:
        """The slot, regrown when this step's arrays outgrow it (doubling: rare)."""
        if ints <= slot.host_in.numel() and sampled <= slot.tokens.numel():
            return slot
        return self._new_slot(max(ints, 2 * slot.host_in.numel()),
                              max(sampled, 2 * slot.tokens.numel()))  # fmt: skip

    def _triton_decode(self, tables: torch.Tensor, context_lens: torch.Tensor) -> Any:
        size = tables.shape[0]
        ones = torch.ones(size, dtype=torch.int64, device=tables.device)
        starts = torch.arange(size, dtype=torch.int64, device=tables.device)
        return self.model.device_attention(tables, starts, ones, context_lens, 1, size)


def _top_lists(
    slot: Slot, count: int, top: int, wanted: list[int | None]
) -> list[list[tuple[int, float]]]:
    ids = slot.top_ids[: count * top].view(count, top).tolist() if top else []
    values = slot.top_values[: count * top].view(count, top).tolist() if top else []
    return [
        list(zip(ids[i][:n], values[i][:n], strict=True)) if n else [] for i, n in enumerate(wanted)
    ]


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
    return PipelinedRunner(model_factory(), num_blocks, block_size, max_blocks_per_row, device,
                           tokenizer_folder, cuda_graphs, graph_max_batch,
                           memory_share=memory_share, step_tokens=step_tokens)  # fmt: skip
