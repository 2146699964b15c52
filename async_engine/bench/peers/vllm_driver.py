"""Run inside vLLM's own interpreter by `bench offline --vllm-python`: stdlib and vllm only.

Reads the job as JSON on stdin (model folder, dtype, prompts as token ids, new tokens per
request), runs it through vLLM's offline ``LLM`` greedy with ``ignore_eos``, after a short
warm-up, and prints one line ``RESULT {json}`` on stdout (vLLM logs to the same streams).
"""

from __future__ import annotations

import json
import sys
import time

MARKER = "RESULT "


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        enforce_eager=True,
        max_num_seqs=job["max_num_seqs"],
        max_model_len=job["max_model_len"],
        seed=0,
    )
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}
    print(MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
