"""async-engine command line: generate (JSONL batch), serve, client, bench, profile."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from sampler.params import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="default | HF folder | .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--overlap", default="on", choices=["on", "off"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device-threads", type=int, default=None)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "overlap": args.overlap == "on",
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": args.num_kv_blocks,
        "max_model_len": args.max_model_len,
        "device_threads": args.device_threads,
    }


PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
OTHER_KEYS = ("id",)


def parse_line(line: str) -> tuple[dict[str, Any], SamplingParams, str | None]:
    """One JSONL request -> (prompt item, params, id). Raises ValueError naming the field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("line must be a JSON object")
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
    key = given[0]
    item = {"messages": obj[key]} if key == "messages" else {"prompt": obj[key]}
    fields = {k: v for k, v in obj.items() if k not in PROMPT_KEYS + OTHER_KEYS}
    return item, SamplingParams.from_dict(fields), obj.get("id")


def cmd_generate(args: argparse.Namespace) -> int:
    from async_engine.llm import LLM

    lines = [line for line in sys.stdin.read().splitlines() if line.strip()]
    parsed: list[Any] = []
    for line in lines:
        try:
            parsed.append(parse_line(line))
        except ValueError as exc:
            parsed.append(exc)
    good = [e for e in parsed if not isinstance(e, Exception)]
    with LLM(**engine_options(args)) as llm:
        results = iter(llm.generate_items([e[0] for e in good], [e[1] for e in good]))
    for entry in parsed:
        if isinstance(entry, Exception):
            print(json.dumps({"error": str(entry)}), flush=True)
            continue
        rid = entry[2]
        out = next(results)
        if isinstance(out, ValueError):
            print(json.dumps({"id": rid, "error": str(out)}), flush=True)
            continue
        record = {
            "id": rid if rid is not None else out.request_id,
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens,
        }
        print(json.dumps(record), flush=True)
    return 0


def _add_profile_parser(sub: Any) -> None:
    # Imported here, not at the top: runtime modules must not import profiling on import.
    from profiling.cli import add_parser

    add_parser(sub, _engine_args)


def attach_profiler(engine: Any, out_dir: str) -> Any:
    """Entry points inject the profiler's on-demand capture; the engine never imports it."""
    from profiling.capture import attach

    return attach(engine, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="async-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="JSONL requests on stdin -> JSONL results, in order")
    _engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    from async_engine import bench, client_cli, serve_cli

    bench.add_parser(sub, _engine_args)
    _add_profile_parser(sub)
    serve_cli.add_parser(sub, _engine_args)
    client_cli.add_parser(sub, _engine_args)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
