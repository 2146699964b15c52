"""The identity phase of ``make gpu-check``: on the same float32 weights, the CUDA engine
(pipelined runner) generates exactly the CPU engine's tokens, with overlap on and off, CUDA
graphs on and off, under forced preemption and under chunked prefill; bfloat16's greedy
agreement with float32 is reported, not judged.

One JSON record per line; exit 1 on any token mismatch. ``--device cpu`` runs the same
comparison against the pipelined runner on the CPU (the tests do).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from async_engine.bench.gpu_models import SHAPES, emit, write_model
from sampler.params import SamplingParams

PROMPT_LENS = (3, 17, 40, 64, 100, 9)  # 100 spans several KV blocks and the chunked budget
MAX_TOKENS = 32
BASE: dict[str, Any] = {
    "dtype": "float32",
    "max_num_seqs": 16,
    "num_kv_blocks": 256,
    "max_model_len": 512,
}
REFERENCE: dict[str, Any] = {"device": "cpu"}
# name -> engine options over BASE, on the device under test.
VARIANTS: dict[str, dict[str, Any]] = {
    "overlap-on": {},
    "overlap-off": {"overlap": False},
    "graphs-off": {"cuda_graphs": False},
    # 12 blocks of 16 tokens hold one request (100 + 32 tokens is 9 blocks), not six.
    "preempt": {"num_kv_blocks": 12},
    "chunked": {"max_num_batched_tokens": 32},
}
BF16 = {"dtype": "bfloat16"}


def workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed-length random prompts; even rows greedy, odd rows seeded sampling."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [
        greedy if i % 2 == 0 else dataclasses.replace(greedy, temperature=0.8, top_p=0.95, seed=i)
        for i in range(len(prompts))
    ]
    return prompts, params


def generate(
    folder: Path, options: dict[str, Any], prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, Any]:
    """Token ids and top logprobs per prompt, and the engine's preemptions."""
    from async_engine.core.llm import LLM

    started = time.monotonic()
    with LLM(str(folder), **{**BASE, **options}) as llm:
        outs = llm.generate(prompts, params)
        preemptions = llm.stats().num_preemptions
    return {
        "tokens": [o.token_ids for o in outs],
        "top": [o.top_logprobs for o in outs],
        "preemptions": preemptions,
        "seconds": round(time.monotonic() - started, 2),
    }


def attempt(
    folder: Path, options: dict[str, Any], prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, Any]:
    """``generate``, or {"error": its traceback's tail}: one variant that crashes must not
    cost the others' results."""
    try:
        return generate(folder, options, prompts, params)
    except Exception:
        return {"error": traceback.format_exc()[-3000:]}


def first_mismatches(
    want: list[list[int]], got: list[list[int]], top: list[Any] | None = None
) -> list[dict[str, Any]]:
    """Per differing prompt: the first index where the tokens differ (or one list ends), and
    where the reference has top-2 logprobs there, their margin (tiny: a near-tie)."""
    out = []
    for row, (a, b) in enumerate(zip(want, got, strict=True)):
        if a == b:
            continue
        pairs = enumerate(zip(a, b, strict=False))  # one may be shorter
        at = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
        entry: dict[str, Any] = {
            "prompt": row,
            "index": at,
            "want": a[at] if at < len(a) else None,
            "got": b[at] if at < len(b) else None,
        }
        pair = top[row][at] if top and top[row] and at < len(top[row]) else None
        if pair is not None and len(pair) >= 2:
            entry["ref_margin"] = pair[0][1] - pair[1][1]
        out.append(entry)
    return out


def agreement(want: list[list[int]], got: list[list[int]], rows: list[int]) -> float:
    """Share of positions, over ``rows``, where both generated the same token."""
    pairs = [(x, y) for r in rows for x, y in zip(want[r], got[r], strict=False)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def check_shape(shape: str, folder: Path, device: str, variants: list[str], bf16: bool) -> bool:
    """The reference once, then each variant on ``device``; one record each."""
    vocab = SHAPES[shape]["vocab_size"]
    prompts, params = workload(vocab)
    # Top-2 logprobs on the reference's greedy rows only: a mismatch's margin tells a near-tie
    # from a bug, and the runs under test keep the plain path.
    with_top = [dataclasses.replace(p, logprobs=2) if p.greedy else p for p in params]
    ref = attempt(folder, REFERENCE, prompts, with_top)
    if "error" in ref:
        emit({"shape": shape, "variant": "cpu-reference", "ok": False, "error": ref["error"]})
        return False
    emit({"shape": shape, "variant": "cpu-reference", "seconds": ref["seconds"]})
    ok = True
    under_test = {"device": device}
    for name in variants:
        run = attempt(folder, {**under_test, **VARIANTS[name]}, prompts, params)
        if "error" in run:
            emit(
                {
                    "shape": shape,
                    "variant": name,
                    "device": device,
                    "ok": False,
                    "error": run["error"],
                }
            )
            ok = False
            continue
        mismatches = first_mismatches(ref["tokens"], run["tokens"], ref["top"])
        good = not mismatches
        record = {
            "shape": shape,
            "variant": name,
            "device": device,
            "ok": good,
            "mismatches": mismatches,
            "seconds": run["seconds"],
        }
        if name == "preempt":  # a run that never preempted proved nothing
            record["preemptions"] = run["preemptions"]
            good &= run["preemptions"] > 0
            record["ok"] = good
        emit(record)
        ok &= good
    if bf16:
        run = attempt(folder, {**under_test, **BF16}, prompts, params)
        if "error" in run:  # the agreement is only reported; a crash is a failure
            emit(
                {
                    "shape": shape,
                    "variant": "bf16-greedy",
                    "device": device,
                    "ok": False,
                    "error": run["error"],
                }
            )
            return False
        greedy = [i for i, p in enumerate(params) if p.greedy]
        emit(
            {
                "shape": shape,
                "variant": "bf16-greedy",
                "device": device,
                "agreement": agreement(ref["tokens"], run["tokens"], greedy),
                "identical_prompts": sum(ref["tokens"][i] == run["tokens"][i] for i in greedy),
                "greedy_prompts": len(greedy),
                "seconds": run["seconds"],
            }
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--bf16", default="on", choices=("on", "off"))
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            emit({"error": "no CUDA device"})
            return 1
    shapes = [s for s in args.shapes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [n for n in shapes if n not in SHAPES] + [n for n in variants if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown shapes or variants: {unknown}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu-identity-") as tmp:
        for shape in shapes:
            folder = write_model(Path(tmp) / shape, SHAPES[shape])
            ok &= check_shape(shape, folder, args.device, variants, args.bf16 == "on")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
