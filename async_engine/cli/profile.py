"""`async-engine profile`: trace the built-in workload, compare overlap modes, nsys in and out.

async-engine profile --steps 100 --overlap on --out DIR   # trace.json, timeline.png, report.txt
async-engine profile --compare --out DIR                  # both modes, printed side by side
async-engine profile --overhead                           # tracer cost on tokens/s
async-engine profile --nsys --out DIR                     # the same run under nsys
async-engine profile import-nsys FILE.sqlite              # idle gaps from nsys kernels
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from async_engine.cli.options import add_engine_args, engine_options

NSYS_MISSING = (
    "nsys (NVIDIA Nsight Systems) is not on PATH. Install Nsight Systems, or run without --nsys: "
    "the built-in tracer needs neither nsys nor a GPU."
)


def add_parser(sub: Any) -> None:
    profile = sub.add_parser("profile", help="step timeline, idle gaps, who waited on whom")
    add_engine_args(profile)
    profile.add_argument("--steps", type=int, default=100, help="decode steps to trace")
    profile.add_argument("--requests", type=int, default=32)
    profile.add_argument("--prompt-len", type=int, default=16)
    profile.add_argument("--out", default="profile-out", help="folder for the exports")
    profile.add_argument("--compare", action="store_true", help="run overlap on and off")
    profile.add_argument("--overhead", action="store_true", help="tokens/s, tracer on vs off")
    profile.add_argument("--rounds", type=int, default=5, help="--overhead: rounds per mode")
    profile.add_argument("--nsys", action="store_true", help="run under `nsys profile`")
    # Set by --nsys on the command it runs inside nsys: bracket the steps with cudaProfilerApi.
    profile.add_argument("--nsys-child", action="store_true", help=argparse.SUPPRESS)
    profile.set_defaults(func=cmd_profile, parser=profile)
    kinds = profile.add_subparsers(dest="profile_command")
    imp = kinds.add_parser("import-nsys", help="idle-gap report from an nsys SQLite export")
    imp.add_argument("file", help="FILE.sqlite from `nsys export --type sqlite`")
    imp.add_argument("--out", default=None, help="also write trace.json, timeline.png here")
    imp.set_defaults(func=cmd_import_nsys)


def _workload(args: argparse.Namespace) -> Any:
    """--steps new tokens for each of --requests prompts of exactly --prompt-len tokens."""
    from async_engine.core.workload import Workload

    for name in ("steps", "requests", "prompt_len"):  # name the flags, not Workload's fields
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return Workload(
        num_requests=args.requests,
        min_prompt=args.prompt_len,
        max_prompt=args.prompt_len,
        max_tokens=args.steps,
    )


def cmd_profile(args: argparse.Namespace) -> int:
    try:
        workload = _workload(args)
        if args.rounds < 1:
            raise ValueError(f"rounds must be positive, got {args.rounds}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.nsys and (args.compare or args.overhead):
        print("error: --nsys traces one run; drop --compare/--overhead", file=sys.stderr)
        return 2
    if args.nsys:
        return run_under_nsys(args)
    options = engine_options(args)
    if args.overhead:
        return _print_overhead(options, workload, args.rounds)
    out = Path(args.out)
    if not args.compare:
        text, _ = _profile_one(options, workload, out, cuda_window=args.nsys_child)
        print(text, end="")
        print(
            f"wrote {', '.join(str(out / f) for f in ('trace.json', 'timeline.png', 'report.txt'))}"
        )
        return 0
    return _compare(options, workload, out)


def _profile_one(options: dict, workload: Any, out: Path, cuda_window: bool = False) -> tuple:
    from profiling.exports import write_exports
    from profiling.workload import run_profile

    run = run_profile(options, workload, cuda_window)
    mode = "on" if run.overlap else "off"
    extra = {
        "workload": f"{workload.num_requests} requests x {workload.max_tokens} tokens, "
        f"prompts of {workload.max_prompt} tokens, ignore_eos",
        "throughput": f"{run.tokens} tokens in {run.seconds:.2f} s = {run.tokens_per_s:.1f} tok/s",
    }
    if run.speculation is not None:
        extra["speculation"] = run.speculation
    text = write_exports(run.trace, out, f"overlap {mode}", run.report, extra)
    return text, run


def _compare(options: dict, workload: Any, out: Path) -> int:
    from profiling.plot import plot_compare
    from profiling.report_text import format_compare

    runs = {}
    for mode in ("on", "off"):
        _, runs[mode] = _profile_one({**options, "overlap": mode == "on"}, workload, out / mode)
    extra = {"tokens/s": (f"{runs['on'].tokens_per_s:.1f}", f"{runs['off'].tokens_per_s:.1f}")}
    text = format_compare(runs["on"].report, runs["off"].report, extra)
    (out / "compare.txt").write_text(text)
    plot_compare(
        [(f"overlap {m}", runs[m].trace, runs[m].report) for m in ("on", "off")],
        out / "compare.png",
    )
    print(text, end="")
    print(
        f"wrote {out}/compare.txt, {out}/compare.png and on/, off/ (trace.json, timeline.png, "
        "report.txt)"
    )
    return 0


def _print_overhead(options: dict, workload: Any, rounds: int) -> int:
    from profiling.workload import measure_overhead

    result = measure_overhead(options, workload, rounds)
    off = ", ".join(f"{v:.1f}" for v in result.tokens_per_s_off)
    on = ", ".join(f"{v:.1f}" for v in result.tokens_per_s_on)
    print(f"tokens/s tracer off: {off}\ntokens/s tracer on:  {on}")
    print(
        f"throughput ratio on/off (median of rounds): {result.throughput_ratio:.4f} "
        f"(cost {100 * (1 - result.throughput_ratio):+.2f} %, includes machine noise)"
    )
    print(
        f"tracer callbacks: {result.callback_us_per_step:.1f} us per step, "
        f"{1e3 * result.mean_step_s:.1f} ms per step "
        f"-> estimated cost {100 * result.estimated_cost:.3f} % (target < 1 %)"
    )
    return 0


def run_under_nsys(args: argparse.Namespace) -> int:
    """Re-run this command inside `nsys profile`, capturing only the traced step window."""
    nsys = shutil.which("nsys")
    if nsys is None:
        print(NSYS_MISSING, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        print(
            "warning: --device cpu runs no CUDA kernels; nsys will show NVTX only", file=sys.stderr
        )
    report = out / "nsys-profile"
    command = [
        nsys,
        "profile",
        "-t",
        "cuda,nvtx",
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop",
        "--force-overwrite=true",
        "-o",
        str(report),
        sys.executable,
        "-m",
        "async_engine.cli.main",
        *child_argv(args),
    ]
    print("running: " + " ".join(command), file=sys.stderr)
    code = subprocess.call(command)
    if code != 0:
        return code
    sqlite = report.with_suffix(".sqlite")
    export = [
        nsys,
        "export",
        "--type",
        "sqlite",
        "--force-overwrite=true",
        "-o",
        str(sqlite),
        str(report.with_suffix(".nsys-rep")),
    ]
    if subprocess.call(export) != 0:
        return 1
    return cmd_import_nsys(argparse.Namespace(file=str(sqlite), out=None))


def child_argv(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces args, without --nsys (the child is inside nsys)."""
    argv = ["profile", "--nsys-child"]
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help", "nsys", "nsys_child"):
            continue
        value = getattr(args, action.dest, None)
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def cmd_import_nsys(args: argparse.Namespace) -> int:
    from profiling.exports import write_exports
    from profiling.nsys import load_nsys
    from profiling.report import analyze
    from profiling.report_text import format_report

    try:
        trace = load_nsys(args.file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = analyze(trace)
    title = f"nsys {Path(args.file).name}"
    if args.out:
        text = write_exports(trace, args.out, title, report)
    else:
        text = format_report(report, title)
    print(text, end="")
    return 0
