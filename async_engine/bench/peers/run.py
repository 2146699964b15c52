"""Runs the peers `bench offline`'s flags name on its workload, one table row each."""

from __future__ import annotations

import argparse
from typing import Any

from async_engine.bench.peers import PeerMissingError
from async_engine.bench.peers.llama_server import run_llama_server
from async_engine.bench.peers.vllm_cpu import run_vllm, vllm_binds


def run_peers(
    args: argparse.Namespace, folder: str, dtype: str, prompts: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """The peers the flags name, on the same workload: llama-server, then vLLM at each binding.

    Each result carries ``name`` (its table row) and ``detail`` (how it ran)."""
    peers: list[dict[str, Any]] = []
    ggufs = args.gguf or []
    if (args.llama_server is None) != (not ggufs):
        print("llama-server peer skipped: give both --llama-server PATH and --gguf FILE")
    elif args.llama_server is not None:
        for gguf in ggufs:
            try:
                r = _twice(run_llama_server, args.llama_server, gguf, prompts, max_tokens)
            except PeerMissingError as exc:
                print(f"llama-server peer skipped: {exc} (../shared/peers/ builds both)")
                continue
            except RuntimeError as exc:
                print(f"llama-server peer failed on {gguf}: {exc}")
                continue
            detail = f"{r['threads']} threads, -np {r['slots']} -cb"
            peers.append({**r, "name": f"llama-server {r['gguf']}", "detail": detail})
    if args.vllm_python is not None:
        for bind in vllm_binds(args.vllm_bind):
            try:
                r = run_vllm(args.vllm_python, folder, dtype, prompts, max_tokens, bind=bind)
            except PeerMissingError as exc:
                print(f"vLLM peer skipped: {exc} (../shared/peers/install-vllm-cpu.sh)")
                break
            except RuntimeError as exc:
                print(f"vLLM peer failed with binding {bind}: {exc}")
                continue
            detail = f"{dtype}, eager, VLLM_CPU_OMP_THREADS_BIND={bind}"
            peers.append({**r, "name": f"vLLM bind={bind}", "detail": detail})
    return peers


def _twice(run: Any, *args: Any) -> Any:
    """A peer that crashed at start (llama-server once segfaulted there, not reproducibly)
    gets one more try; the first failure is printed."""
    try:
        return run(*args)
    except RuntimeError as exc:
        print(f"peer failed, trying once more: {exc}")
        return run(*args)
