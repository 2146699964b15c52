"""The CPU peer in `bench offline`: the same workload through llama.cpp's `llama-server`.

The server is started on loopback with one slot per request (``-np N -cb``), every core,
and a context large enough for every slot's longest request; all prompts are sent at once
as token ids (``/completion``, greedy, ``ignore_eos``, ``n_predict`` new tokens) and the
wall time from the first send to the last reply gives tokens/s, as for the engine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from async_engine.bench.peers import PeerMissingError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Any) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"llama-server exited with code {proc.returncode} at start:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server was not healthy within {timeout:.0f} s")


def run_llama_server(
    binary: str,
    gguf: str,
    prompts: list[list[int]],
    max_tokens: int,
    threads: int | None = None,
    start_timeout: float = 120.0,
) -> dict[str, Any]:
    """tokens/s of ``llama-server`` on the workload; raises PeerMissingError when absent."""
    for label, path in (("--llama-server", binary), ("--gguf", gguf)):
        if not Path(path).is_file():
            raise PeerMissingError(f"{label} {path}: no such file")
    slots = len(prompts)
    per_slot = max(len(p) for p in prompts) + max_tokens + 16
    threads = threads or os.cpu_count() or 1
    port = _free_port()
    cmd = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-cb",
        "-t",
        str(threads),
        "-c",
        str(slots * per_slot),
    ]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, start_timeout, log)

            def one(prompt: list[int]) -> int:
                body = {
                    "prompt": prompt,
                    "n_predict": max_tokens,
                    "temperature": 0.0,
                    "top_k": 1,
                    "ignore_eos": True,
                    "cache_prompt": False,
                }
                return int(_post(f"{url}/completion", body, timeout=3600)["tokens_predicted"])

            one(prompts[0][:16])  # warm-up
            with ThreadPoolExecutor(max_workers=slots) as pool:
                start = time.perf_counter()
                tokens = sum(pool.map(one, prompts))
                wall = time.perf_counter() - start
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "threads": threads,
        "slots": slots,
        "gguf": Path(gguf).name,
        "command": " ".join(cmd),
    }
