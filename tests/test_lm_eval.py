"""lm-eval's ``local-completions`` against the server scores a multiple-choice task as its
own ``hf`` backend does on the same float32 weights: the same loglikelihood for every
choice of every question, the same accuracy (the harness sends ``echo``, ``logprobs`` and
token-id prompts, and reads the prompt's ``token_logprobs``).

lm-eval is heavy (datasets, evaluate, scikit-learn), so it is not a test dependency: this
suite runs only with ``-m lm_eval`` and ``LM_EVAL_PYTHON`` naming an interpreter that has
lm-eval 0.4 (``python3 -m venv V && V/bin/pip install torch==2.13.0 "lm-eval[api,hf]==0.4.13"``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from server_helpers import http_server

pytestmark = pytest.mark.lm_eval


def test_local_completions_scores_equal_the_hf_backends(default_model: Path):
    python = os.environ.get("LM_EVAL_PYTHON")
    if not python:
        pytest.fail("set LM_EVAL_PYTHON to an interpreter with lm-eval to run this suite")
    server = http_server(default_model, dtype="float32", device_threads=2)
    try:
        url = f"http://127.0.0.1:{server.server.http_port}/v1/completions"
        script = Path(__file__).parent / "lm_eval" / "compare.py"
        done = subprocess.run(
            [python, str(script), url, str(default_model)],
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
    finally:
        server.close()
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    ours, theirs = found["local-completions"], found["hf"]
    assert ours["acc"] == theirs["acc"]
    for mine, want in zip(ours["loglikelihoods"], theirs["loglikelihoods"], strict=True):
        assert mine == pytest.approx(want, abs=2e-3)
