"""The committed gRPC stubs match proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "async_engine/v1/generation.proto"
GENERATED = ("generation_pb2.py", "generation_pb2_grpc.py", "generation_pb2.pyi")
# The grpcio-tools release that made a stub: the least grpcio it runs on, not its contents.
TOOLS_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_committed_stubs_equal_freshly_generated_ones(tmp_path: Path) -> None:
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        str(ROOT / "proto" / PROTO),
    ]
    assert protoc.main(args) == 0
    for name in GENERATED:
        fresh = (tmp_path / "async_engine" / "v1" / name).read_text()
        committed = (ROOT / "async_engine" / "v1" / name).read_text()
        made_with = TOOLS_VERSION.findall(committed)
        fresh = TOOLS_VERSION.sub(lambda _: "GRPC_GENERATED_VERSION = '-'", fresh)
        committed = TOOLS_VERSION.sub(lambda _: "GRPC_GENERATED_VERSION = '-'", committed)
        assert fresh == committed, f"{name} is stale: run `make proto`"
        for version in made_with:  # the installed grpcio must run what the stub was made for
            assert _version(grpc.__version__) >= _version(version)


def test_stubs_import_as_a_package_module() -> None:
    from async_engine.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "async_engine.v1"
    assert hasattr(generation_pb2_grpc, "GenerationStub")
