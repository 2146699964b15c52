"""The kernel phase of ``make gpu-check``: the Triton attention kernels and the CUDA glue
kernels on the GPU against their torch references, and decode attention timed against the
gather path with CUDA events. One JSON object per line on stdout; exit 1 on a mismatch.

Needs only torch, triton, numpy (and cupy for the glue kernels): a GPU host without a
package index has them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from async_engine.model.attention import paged_attention
from async_engine.model.attention_plan import AttentionPlan
from streams.batch import ForwardBatch

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
MIXED = [(1, 1), (20, 120), (1, 290), (37, 37), (1, 33), (64, 1000)]
# (query heads, KV heads, head_dim): the default model's shape and an 8B model's.
SHAPES = [(9, 3, 64), (32, 8, 128)]


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def step(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[Any, ...]:
    """A random paged cache, this step's queries and K/V, and its ForwardBatch, on the GPU."""
    num_heads, kv_heads, head_dim = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-ctx // block_size) for _, ctx in seqs]
    total = sum(need) + 4
    perm = torch.randperm(total, generator=gen, device="cuda")
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int64, device="cuda")
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used : used + n]
        used += n
    shape = (total, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    positions = torch.cat([torch.arange(ctx - q, ctx, device="cuda") for q, ctx in seqs])
    owner = torch.cat([torch.full((q,), i, device="cuda") for i, (q, _) in enumerate(seqs)])
    slots = tables[owner, positions // block_size] * block_size + positions % block_size
    tokens = len(positions)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    k = k_cache.view(-1, kv_heads, head_dim)[slots].clone()
    v = v_cache.view(-1, kv_heads, head_dim)[slots].clone()
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
        positions=positions,
        slot_mapping=slots,
        query_lens=[q for q, _ in seqs],
        context_lens=[c for _, c in seqs],
        block_tables=tables,
        logits_indices=torch.arange(tokens, device="cuda"),
    )
    return q, k, v, k_cache, v_cache, batch


def attend(inputs: tuple[Any, ...], block_size: int, triton: bool) -> torch.Tensor:
    q, k, v, k_cache, v_cache, batch = inputs
    plan = AttentionPlan.build(batch, block_size, False, k_cache, triton=triton)
    return paged_attention(q, k, v, k_cache, v_cache, batch.slot_mapping, plan)


def check_attention() -> bool:
    ok = True
    for heads in SHAPES:
        for block_size in (16, 32):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for name, seqs in (("mixed", MIXED), ("decode", [(1, c) for c in (1, 77, 2048)])):
                    inputs = step(seqs, heads, block_size, dtype)
                    q, k, v, k_cache, v_cache, batch = inputs
                    ref = attend(
                        (q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), batch),
                        block_size,
                        triton=False,
                    )
                    out = attend(inputs, block_size, triton=True).float()
                    atol, rtol = TOLERANCE[dtype]
                    err = (out - ref).abs().max().item()
                    good = bool(((out - ref).abs() <= atol + rtol * ref.abs()).all())
                    ok &= good
                    emit(
                        {
                            "check": "attention",
                            "case": name,
                            "heads": heads,
                            "block_size": block_size,
                            "dtype": str(dtype),
                            "max_err": err,
                            "ok": good,
                        }
                    )
    return ok


def check_glue() -> bool:
    from streams import cuda_kernels

    ids = torch.tensor([5, -1, 7, -1], device="cuda")
    want = ids.clone()
    slots, buffer = torch.tensor([0, 1, 2, 3], device="cuda"), torch.arange(10, 14, device="cuda")
    cuda_kernels.fill_placeholders(ids, slots, buffer)
    cuda_kernels.fill_placeholders_twin(want, slots, buffer)
    # Every kernel of cuda/*.cu must load through NVRTC: the engine would fall back to its
    # torch twin with a log line only, and this check is where that must fail loudly.
    fell_back = [
        f"{module}:{name}"
        for module, name in cuda_kernels.kernel_names()
        if cuda_kernels._kernel(module, name) is None
    ]
    good = not fell_back and torch.equal(ids, want)
    emit({"check": "glue", "fell_back": fell_back, "ok": good})
    return good


def time_decode(batch_size: int, context: int, heads: tuple[int, int, int]) -> None:
    """Decode attention of one layer: the Triton kernel against gather + SDPA, CUDA events."""
    q, k, v, k_cache, v_cache, batch = step([(1, context)] * batch_size, heads, 16, torch.bfloat16)
    times = {}
    for triton in (True, False):
        # Planned once, as a step is for all its layers: the timing is one layer's attention.
        plan = AttentionPlan.build(batch, 16, False, k_cache, triton=triton)

        def layer(plan: AttentionPlan = plan) -> None:
            paged_attention(q, k, v, k_cache, v_cache, batch.slot_mapping, plan)

        for _ in range(3):
            layer()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            layer()
        end.record()
        end.synchronize()
        times["triton" if triton else "gather"] = start.elapsed_time(end) / 20
    emit(
        {
            "timing": "decode_attention",
            "batch": batch_size,
            "context": context,
            "heads": heads,
            "ms_triton": times["triton"],
            "ms_gather": times["gather"],
            "gather_over_triton": times["gather"] / times["triton"],
        }
    )


def main() -> int:
    if not torch.cuda.is_available():
        emit({"error": "no CUDA device"})
        return 1
    ok = check_attention()
    ok &= check_glue()
    for heads in SHAPES:
        for batch_size, context in ((64, 1024), (256, 1024), (64, 8192)):
            time_decode(batch_size, context, heads)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
