"""Regenerates the committed Python code (messages, gRPC stubs, typed .pyi stubs) from proto/."""

from __future__ import annotations

import os
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = PROTO_DIR


def generate(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    """Runs protoc over every .proto under proto/, writing into `out_dir`; returns the files made."""
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    # protoc finds the mypy-protobuf plugins (protoc-gen-mypy, ...) on PATH, beside this Python.
    os.environ["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(path)
