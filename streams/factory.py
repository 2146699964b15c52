"""The device spec for each kind (cpu, cuda, sim); every kind runs in a device process."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from streams.device import Device, DeviceSpec
from streams.drafting.base import Drafter
from streams.grammar import TokenizerSource
from streams.pipeline.runner import build_pipelined_runner
from streams.process_device import ProcessDevice
from streams.sim import CostModel
from streams.sim_runner import build_sim_runner

KINDS = ("cpu", "cuda", "sim")


def model_spec(
    kind: str,
    model_factory: Callable[[], Any],
    num_blocks: int | None,
    block_size: int,
    max_blocks_per_row: int,
    threads: int,
    tokenizer: TokenizerSource | None = None,
    cuda_graphs: bool = True,
    graph_max_batch: int = 80,
    memory_share: float = 0.9,
    step_tokens: int = 512,
    drafter: Callable[[], Drafter] | None = None,
    graph_tokens_per_row: int = 1,
) -> DeviceSpec:
    """A device that runs the model: on the CPU with ``threads`` torch threads, or on CUDA,
    through the one model runner (``streams.pipeline.runner``). ``tokenizer`` lets it
    compile grammars for structured output; ``drafter`` builds (in the device process) the
    drafter of rows that verify drafts, whose steps of up to ``graph_tokens_per_row`` tokens
    a row run in CUDA graphs."""
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"a model device is cpu or cuda, got {kind!r}")
    if num_blocks is None and kind != "cuda":
        raise ValueError("num_blocks is sized from GPU memory only on CUDA")
    factory = functools.partial(
        build_pipelined_runner,
        model_factory,
        num_blocks,
        block_size,
        max_blocks_per_row,
        kind,
        tokenizer,
        cuda_graphs,
        graph_max_batch,
        memory_share,
        step_tokens,
        drafter,
        graph_tokens_per_row,
    )
    return DeviceSpec(factory, threads if kind == "cpu" else 1)


def sim_spec(
    cost: CostModel,
    vocab_size: int,
    eos_ids: tuple[int, ...],
    block_size: int,
    max_blocks_per_row: int,
    drafter: Callable[[], Drafter] | None = None,
    repeat: float = 0.0,
) -> DeviceSpec:
    """The simulated device: no torch, no weights, a modelled step time; ``repeat``: the
    share of positions whose token repeats earlier text (``streams.sim_text``)."""
    factory = functools.partial(
        build_sim_runner,
        cost,
        vocab_size,
        eos_ids,
        block_size,
        max_blocks_per_row,
        drafter,
        repeat,
    )
    return DeviceSpec(factory, threads=0)


def create_device(spec: DeviceSpec) -> Device:
    return ProcessDevice(spec)
