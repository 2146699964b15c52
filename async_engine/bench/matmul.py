"""The matmul-only time of a decode step: the same weights and shapes, nothing else.

`bench offline` prints it beside the engine's steady-decode step time, so the share of a
step spent outside the matrix multiplies (attention, norms, sampling, the handoff) shows.
"""

from __future__ import annotations

import statistics
import time

import torch


def matmul_only_ms(
    folder: str,
    dtype: str,
    batch: int,
    threads: int,
    reps: int = 20,
    device: str = "cpu",
    load_format: str = "auto",
    quantization: str = "none",
) -> float:
    """Median ms of one decode step's matmuls (every layer's qkv, o, gate|up and down, and the
    head) at ``batch`` rows, with the model's packed weights and ``threads`` torch threads, on
    the engine's device and with its weights (``load_format`` "dummy": random ones) and
    ``quantization``."""
    from async_engine.model import build_model
    from async_engine.model.llama import linear

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(folder, dtype, device, load_format, quantization=quantization)
        cfg = model.cfg
        hidden = torch.randn(batch, cfg.hidden_size, device=device).to(model.dtype)
        heads = torch.randn(batch, cfg.num_heads * cfg.head_dim, device=device).to(model.dtype)
        inter = torch.randn(batch, cfg.intermediate_size, device=device).to(model.dtype)
        # A GPU returns before its work is done: wait for it, or the clock reads the launch.
        sync = torch.cuda.synchronize if device == "cuda" else lambda: None

        def step() -> None:
            for layer in model.layers:
                linear(hidden, layer.qkv, layer.qkv_bias)
                linear(heads, layer.o_proj)
                linear(hidden, layer.gate_up)
                linear(inter, layer.down)
            linear(hidden, model.lm_head)

        with torch.inference_mode():
            step()
            sync()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)
    finally:
        torch.set_num_threads(before)
