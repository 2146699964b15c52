"""The matmul-only time of a decode step: the same weights and shapes, nothing else.

`bench offline` prints it beside the engine's steady-decode step time, so the share of a
step spent outside the matrix multiplies (attention, norms, sampling, the handoff) shows.
"""

from __future__ import annotations

import statistics
import time

import torch


def matmul_only_ms(folder: str, dtype: str, batch: int, threads: int, reps: int = 20) -> float:
    """Median ms of one decode step's matmuls (every layer's qkv, o, gate|up and down, and the
    head) at ``batch`` rows, with the model's packed weights and ``threads`` torch threads."""
    from async_engine.model import build_model
    from async_engine.model.llama import linear

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(folder, dtype, "cpu")
        cfg = model.cfg
        hidden = torch.randn(batch, cfg.hidden_size).to(model.dtype)
        heads = torch.randn(batch, cfg.num_heads * cfg.head_dim).to(model.dtype)
        inter = torch.randn(batch, cfg.intermediate_size).to(model.dtype)

        def step() -> None:
            for layer in model.layers:
                linear(hidden, layer.qkv, layer.qkv_bias)
                linear(heads, layer.o_proj)
                linear(hidden, layer.gate_up)
                linear(inter, layer.down)
            linear(hidden, model.lm_head)

        with torch.inference_mode():
            step()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)
    finally:
        torch.set_num_threads(before)
