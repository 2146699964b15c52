"""`async-engine bench prefill`: how fast one long prompt reaches its first token.

Agent backends send prompts of thousands of tokens; this measures a single prompt of each
length alone on the engine (time to its first token, prompt tokens per second) and, given
``--llama-bench`` and ``--gguf``, llama.cpp's ``llama-bench -p N -n 0`` with every core on
the same lengths, and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from sampler.params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,8000", help="prompt lengths, comma separated")
    p.add_argument("--llama-bench", default=None, help="llama-bench binary: run it as a peer")
    p.add_argument("--gguf", default=None, help="GGUF of the same model for --llama-bench")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts")


def engine_prefill(options: dict[str, Any], lengths: list[int], seed: int) -> dict[int, float]:
    """Prompt tokens per second of one prompt of each length, alone on the engine."""
    from async_engine.core.llm import LLM

    rng = random.Random(seed)
    out = {}
    with LLM(**options) as llm:
        if max(lengths) >= llm.engine.max_model_len:
            raise ValueError(
                f"lengths must stay below the context length {llm.engine.max_model_len}"
            )
        vocab = llm.engine.model_config.vocab_size
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.generate([[rng.randrange(100, vocab) for _ in range(64)]], one)  # warm-up
        for n in lengths:
            prompt = [rng.randrange(100, vocab) for _ in range(n)]
            start = time.perf_counter()
            llm.generate([prompt], one)
            out[n] = n / (time.perf_counter() - start)
    return out


def llama_bench_prefill(binary: str, gguf: str, lengths: list[int]) -> dict[int, float] | None:
    """llama-bench's prompt-processing tokens/s (``-p N -n 0``, every core), or None."""
    for label, path in (("--llama-bench", binary), ("--gguf", gguf)):
        if not Path(path).is_file():
            print(f"llama-bench peer skipped: {label} {path}: no such file")
            return None
    threads = str(os.cpu_count() or 1)
    cmd = [
        binary,
        "-m",
        gguf,
        "-p",
        ",".join(map(str, lengths)),
        "-n",
        "0",
        "-t",
        threads,
        "-o",
        "json",
        "-r",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        print(f"llama-bench failed ({proc.returncode}): {proc.stderr[-500:]}")
        return None
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(proc.stdout)}


def cmd_prefill(args: argparse.Namespace) -> int:
    from async_engine.cli.options import engine_options

    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 1:
        raise SystemExit("--lengths: give positive prompt lengths, e.g. 1024,4096")
    options = engine_options(args)
    ours = engine_prefill(options, lengths, args.workload_seed)
    peer = None
    if args.llama_bench or args.gguf:
        if not (args.llama_bench and args.gguf):
            print("llama-bench peer skipped: give both --llama-bench PATH and --gguf FILE")
        else:
            peer = llama_bench_prefill(args.llama_bench, args.gguf, lengths)
    print(f"{'prompt tokens':>14}{'engine tok/s':>16}{'llama-bench tok/s':>20}{'ratio':>8}")
    for n in lengths:
        theirs = peer.get(n) if peer else None
        ratio = f"{ours[n] / theirs:8.2f}" if theirs else f"{'-':>8}"
        shown = f"{theirs:20.1f}" if theirs else f"{'-':>20}"
        print(f"{n:>14}{ours[n]:>16.1f}{shown}{ratio}")
    return 0
