"""The vLLM peer in `bench offline`: the same workload through vLLM's CPU build.

vLLM lives in its own interpreter (``../shared/peers/install-vllm-cpu.sh``: it pins its own
torch), so the workload runs there as a subprocess (`vllm_driver.py`) and comes back as one
JSON line. Each thread binding asked for is a separate run: vLLM's default (``auto``) keeps
a core for its scheduler process, which on a machine of few cores may not be its best.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from async_engine.bench.peers import PeerMissingError
from async_engine.bench.peers.vllm_driver import MARKER

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def _preload(python: str) -> str:
    """tcmalloc and vLLM's torch's libgomp, as vLLM's CPU docs ask, where they exist."""
    venv = Path(python).resolve().parent.parent
    gomp = glob.glob(str(venv / "lib/python3*/site-packages/torch/lib/libgomp*.so*"))
    libs = [TCMALLOC] if Path(TCMALLOC).is_file() else []
    return ":".join(libs + gomp[:1])


def run_vllm(
    python: str,
    model: str,
    dtype: str,
    prompts: list[list[int]],
    max_tokens: int,
    bind: str = "auto",
    kv_cache_gib: int = 4,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """tokens/s of vLLM's offline LLM on the workload, with ``VLLM_CPU_OMP_THREADS_BIND=bind``.

    Raises PeerMissingError when ``python`` is not an interpreter, RuntimeError when vLLM
    fails (the tail of its output in the message)."""
    if not Path(python).is_file():
        raise PeerMissingError(f"--vllm-python {python}: no such file")
    job = {
        "model": model,
        "dtype": dtype,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "max_num_seqs": len(prompts),
        "max_model_len": max(len(p) for p in prompts) + max_tokens + 16,
    }
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "LD_PRELOAD": _preload(python),
    }
    env.pop("PYTHONPATH", None)  # vLLM's interpreter must not see this project's packages
    driver = Path(__file__).with_name("vllm_driver.py")
    proc = subprocess.run(
        [python, str(driver)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"vLLM (bind {bind}) exited with code {proc.returncode}:\n{tail}")
    result = json.loads(lines[-1][len(MARKER) :])
    return {**result, "bind": bind, "dtype": dtype}


def vllm_binds(spec: str, cores: int | None = None) -> list[str]:
    """``--vllm-bind``'s comma list as VLLM_CPU_OMP_THREADS_BIND values; ``all`` is every core."""
    cores = cores or os.cpu_count() or 1
    binds = [b.strip() for b in spec.split(",") if b.strip()]
    if not binds:
        raise ValueError("--vllm-bind: give at least one binding, e.g. auto,all")
    return [f"0-{cores - 1}" if b == "all" else b for b in binds]
