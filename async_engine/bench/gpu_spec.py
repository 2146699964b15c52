"""The speculation phase of ``make gpu-check``: greedy tokens identical with and without
speculative decoding on the device (float32; n-gram drafts with overlap on and the verify
steps in CUDA graphs, overlap off, graphs off; suffix drafts made ahead on the host over the
steps in flight, overlap on), then tokens/s and device idle with and without it (n-gram and
suffix) at batch 1, 16 and 64 (bf16, reported, not judged). Eight engine starts in all: each
engine runs every batch it can.

The GPU host has no tokenizer of the default model, so the workload is random prompts on
random weights written on the spot: the model's body with a vocabulary of ``VOCAB`` tokens
and layer weights of std ``WEIGHT_STD``. At the identity phase's 0.1 the greedy tokens of such
a model never repeat within a run, so nothing would be drafted; at 0.035 the embedding
dominates the residual stream and greedy decoding settles into runs of one token that change
now and then, so drafts are mostly accepted and sometimes rejected (both paths verified).
The drafts are short (the latest earlier occurrence of a run's suffix is one token back), so
the speed figures say what a verify step costs at these batch sizes, not what agent traffic
would gain (``bench spec`` on the CPU or the sim does that).

One JSON record per line; exit 1 on any token mismatch or crash. ``--device cpu`` runs the
same on the CPU.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from async_engine.bench.gpu_identity import first_mismatches
from async_engine.bench.gpu_models import SHAPES, emit, write_model
from sampler.params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
BASE: dict[str, Any] = {"max_num_seqs": 64, "num_kv_blocks": 2048, "max_model_len": 512}
# name -> (engine options over BASE, speculative config) for the identity runs (float32).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "overlap-on": ({}, SPEC),
    "overlap-off": ({"overlap": False}, SPEC),
    "graphs-off": ({"cuda_graphs": False}, SPEC),
    "suffix-overlap-on": ({}, SUFFIX),
}
SPEED_METHODS = {"ngram": SPEC, "suffix": SUFFIX}
BATCHES = (1, 16, 64)
VOCAB = 1024
WEIGHT_STD = 0.035


def prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of 16 to 64 tokens, each holding a span it repeats."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        span = [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 32))]
        out.append(span + [rng.randrange(3, vocab) for _ in range(4)] + span)
    return out


def run(
    folder: Path, options: dict[str, Any], batches: list[list[list[int]]], tokens: int
) -> list[dict]:
    """One engine, the batches one after another (an engine start costs more on a GPU
    than the runs themselves)."""
    from async_engine.core.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out = []
    with LLM(str(folder), **{**BASE, **options}) as llm:
        warm = batches[0][:2]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        for batch in batches:
            before = llm.stats().as_dict()
            start = time.perf_counter()
            outs = llm.generate(batch, params)
            seconds = time.perf_counter() - start
            out.append(_measured(before, llm.stats().as_dict(), outs, seconds))
    return out


def _measured(before: dict, after: dict, outs: list, seconds: float) -> dict:
    def grew(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    drafts, draft_tokens = grew("spec_num_drafts"), grew("spec_num_draft_tokens")
    accepted, steps = grew("spec_num_accepted_tokens"), grew("spec_verify_steps")
    idle = grew("device_idle_seconds")
    return {
        "tokens": [o.token_ids for o in outs],
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
        "acceptance": accepted / draft_tokens if draft_tokens else 0.0,
        "accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "verify_steps": steps,
        "gated_steps": grew("spec_gated_steps"),
        "verify_extra_ms": 1e3 * grew("spec_verify_extra_device_seconds") / max(1, steps),
        # the device's share of the run spent waiting for a plan while requests had work
        "device_idle": idle / max(idle + grew("device_busy_seconds"), 1e-9),
    }


def attempt(*args: Any) -> list[dict] | str:
    try:
        return run(*args)
    except Exception:
        return traceback.format_exc()[-3000:]


def identity(folder: Path, device: str, vocab: int) -> bool:
    """Each variant's speculating tokens against plain decoding's (the identity phase has
    shown plain decoding the same in every variant)."""
    batch = [prompts(vocab, 8)]
    plain = attempt(folder, {"device": device, "dtype": "float32"}, batch, 48)
    ok = True
    for name, (variant, method) in VARIANTS.items():
        options = {"device": device, "dtype": "float32", **variant}
        spec = attempt(folder, {**options, "speculative_config": {**method, "adaptive": False}},
                       batch, 48)  # fmt: skip
        record: dict[str, Any] = {"check": "identity", "variant": name, "device": device}
        errors = [r for r in (plain, spec) if isinstance(r, str)]
        if errors:
            emit({**record, "ok": False, "error": errors[0]})
            ok = False
            continue
        got = spec[0]
        mismatches = first_mismatches(plain[0]["tokens"], got["tokens"])
        # Tokens verified both ways: some drafts accepted, some rejected (rolled back).
        good = not mismatches and 0 < got["acceptance"] < 1
        emit({**record, "ok": good, "mismatches": mismatches, "acceptance": got["acceptance"],
              "accepted_length": got["accepted_length"], "verify_steps": got["verify_steps"]})  # fmt: skip
        ok &= good
    return ok


def speed(folder: Path, device: str, vocab: int) -> bool:
    batches = [prompts(vocab, 2 * size, seed=size) for size in BATCHES]
    options = {"device": device, "dtype": "bfloat16"}
    off = attempt(folder, options, batches, 128)
    ok = True
    for method, config in SPEED_METHODS.items():
        on = attempt(folder, {**options, "speculative_config": config}, batches, 128)
        errors = [r for r in (off, on) if isinstance(r, str)]
        if errors:
            emit({"check": "speed", "method": method, "device": device, "ok": False,
                  "error": errors[0]})  # fmt: skip
            ok = False
            continue
        for size, plain, spec in zip(BATCHES, off, on, strict=True):
            emit({"check": "speed", "method": method, "batch": size, "device": device,
                  "ok": True, "off_tokens_per_s": round(plain["tokens_per_s"], 1),
                  "tokens_per_s": round(spec["tokens_per_s"], 1),
                  "ratio": round(spec["tokens_per_s"] / plain["tokens_per_s"], 3),
                  "off_device_idle": round(plain["device_idle"], 4),
                  "device_idle": round(spec["device_idle"], 4),
                  "acceptance": round(spec["acceptance"], 3),
                  "accepted_length": round(spec["accepted_length"], 2),
                  "verify_steps": spec["verify_steps"], "gated_steps": spec["gated_steps"],
                  "verify_extra_ms": round(spec["verify_extra_ms"], 3)})  # fmt: skip
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--checks", default="identity,speed")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            emit({"error": "no CUDA device"})
            return 1
    checks = [c for c in args.checks.split(",") if c]
    if set(checks) - {"identity", "speed"}:
        parser.error(f"unknown checks in {args.checks!r}; known: identity, speed")
    vocab = VOCAB
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu-spec-") as tmp:
        config = {**SHAPES[args.shape], "vocab_size": vocab}
        folder = write_model(Path(tmp) / args.shape, config, weight_std=WEIGHT_STD)
        if "identity" in checks:
            ok &= identity(folder, args.device, vocab)
        if "speed" in checks:
            ok &= speed(folder, args.device, vocab)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
