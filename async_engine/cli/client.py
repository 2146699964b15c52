"""`async-engine client "prompt"`: stream a completion from a running server to the terminal."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from async_engine.cli.serve import AUTH_ENV


def add_parser(sub: Any) -> None:
    p = sub.add_parser("client", help="stream a completion from an async-engine server")
    p.add_argument("prompt", help="prompt text (with --chat: the user message)")
    p.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat user message")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--request-id", default="")
    p.add_argument("--tenant", default="")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="one JSON object per server message")
    p.add_argument("--auth-token", default=None, help=f"bearer token (default: ${AUTH_ENV})")
    p.add_argument("--tls-ca", default=None, help="PEM root certificate: connect with TLS")
    p.set_defaults(func=cmd_client)


def cmd_client(args: argparse.Namespace) -> int:
    from async_engine.client import Chunk, Client, EngineError, Finished

    token = args.auth_token if args.auth_token is not None else os.environ.get(AUTH_ENV) or None
    root = open(args.tls_ca, "rb").read() if args.tls_ca else None
    options: dict[str, Any] = {
        "request_id": args.request_id,
        "tenant": args.tenant,
        "max_tokens": args.max_tokens,
        "min_tokens": args.min_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
        "n": args.n,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos or None,
        "logprobs": args.logprobs,
    }
    prompt: str | None = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        options["messages"], prompt = messages, None
    multi = (args.n or 1) > 1
    texts: dict[int, str] = {}
    try:
        with Client(args.target, token=token, root_certificates=root) as client:
            for event in client.generate(prompt, timeout=args.timeout, **options):
                if args.json:
                    kind = type(event).__name__.lower()
                    print(json.dumps({"type": kind, **dataclasses.asdict(event)}), flush=True)
                elif isinstance(event, Chunk):
                    if multi:  # interleaved streams are unreadable: print each one whole
                        texts[event.index] = texts.get(event.index, "") + event.text
                    else:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                elif isinstance(event, Finished):
                    if multi:
                        print(f"--- [{event.index}] ({event.reason})\n{texts.get(event.index, '')}")
                    else:
                        print(
                            f"\n[{event.reason}, {event.completion_tokens} tokens, "
                            f"ttft {event.ttft_s * 1000:.0f} ms]",
                            file=sys.stderr,
                        )
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        for path, description in err.field_violations.items():
            print(f"  {path}: {description}", file=sys.stderr)
        return 1
    return 0
