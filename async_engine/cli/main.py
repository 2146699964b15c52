"""async-engine command line: generate (JSONL batch), serve, serve-ray, client, bench, profile."""

from __future__ import annotations

import argparse
import os
import sys

from async_engine.cli import bench, client, generate, profile, serve, serve_ray


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="async-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, serve, serve_ray, client, bench, profile):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
