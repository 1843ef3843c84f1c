"""Generates the Python modules of every .proto file in protos/ (grpcio-tools), in place.

    python protos/codegen.py          # regenerate protos/*_pb2.py (+ _pb2_grpc.py, .pyi)
    python protos/codegen.py --check  # exit 1 if the committed files differ (CI runs this)

Generated files are committed so that installing pdserve needs no code generator. They are
made with the grpcio-tools pinned in pyproject.toml. `--check` accepts a file that differs byte
for byte when it means the same (another grpcio-tools or protobuf build writes other version
stamps, formatting and literal splits): the FileDescriptorProto each _pb2.py registers (parsed,
so field order and json_name do not matter), the RPC paths of each _pb2_grpc.py, and the names
each .pyi stub declares. A .proto edited without regenerating changes the descriptor: caught.
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTOS = Path(__file__).resolve().parent
ROOT = PROTOS.parent


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc on every protos/*.proto into `out_dir/protos`; returns the files written."""
    from grpc_tools import protoc

    sources = sorted(PROTOS.glob("*.proto"))
    target = out_dir / "protos"
    target.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    for src in sources:
        args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
                f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(src)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {src.name}")
    return sorted(p for p in target.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def generator_version(grpc_file: Path) -> str | None:
    """The grpcio-tools version a _pb2_grpc.py was generated with."""
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", grpc_file.read_text(), re.M)
    return match.group(1) if match else None


def meaning(path: Path) -> object:
    """What a generated file says, whatever generator version wrote it."""
    text = path.read_text()
    if path.name.endswith("_pb2.py"):
        return _descriptor(text)
    if path.name.endswith("_pb2_grpc.py"):
        return sorted(set(re.findall(r"['\"](/[\w.]+/\w+)['\"]", text)))
    return sorted(set(re.findall(r"^\s*(?:class|def)?\s*(\w+)\s*[:(]", text, re.M)))  # .pyi names


def _descriptor(text: str) -> object:
    """The FileDescriptorProto a _pb2.py registers (the argument of AddSerializedFile, however the
    bytes literal is split), with json_name cleared; the text itself if none is found."""
    from google.protobuf import descriptor_pb2

    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "AddSerializedFile" and node.args):
            proto = descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(node.args[0]))
            messages = list(proto.message_type)
            while messages:
                message = messages.pop()
                messages.extend(message.nested_type)
                for f in message.field:
                    f.ClearField("json_name")
            return proto.SerializeToString(deterministic=True)
    return text


def same(produced: Path, committed: Path) -> bool:
    if not committed.exists():
        return False
    return filecmp.cmp(produced, committed, shallow=False) or meaning(produced) == meaning(committed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        produced = generate(Path(tmp))
        grpc_files = [p for p in produced if p.name.endswith("_pb2_grpc.py")]
        ours = generator_version(grpc_files[0]) if grpc_files else None
        committed = generator_version(PROTOS / grpc_files[0].name) \
            if grpc_files and (PROTOS / grpc_files[0].name).exists() else None
        identical = all(PROTOS.joinpath(p.name).exists() and filecmp.cmp(p, PROTOS / p.name, shallow=False)
                        for p in produced)
        stale = [p.name for p in produced if not same(p, PROTOS / p.name)]
        expected = {p.name for p in produced}
        extra = [p.name for p in PROTOS.iterdir()
                 if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")) and p.name not in expected]
        if args.check:
            if stale or extra:
                print(f"generated protobuf code is out of date: {sorted(stale + extra)}; "
                      f"run `python protos/codegen.py` (committed with grpcio-tools {committed}, "
                      f"this environment has {ours})", file=sys.stderr)
                return 1
            how = ("" if identical else f"; same meaning, other bytes: generated with grpcio-tools "
                                         f"{committed}, this environment has {ours}")
            print(f"protos up to date ({len(produced)} files{how})")
            return 0
        for p in produced:
            shutil.copy(p, PROTOS / p.name)
        for name in extra:
            (PROTOS / name).unlink()
        print(f"wrote {len(produced)} files")
    return 0


def _with_grpc_tools() -> None:
    """grpcio-tools lives in the project's venv (`make setup`): an interpreter without it (a bare
    `python3 protos/codegen.py --check`, as a pre-stop hook runs it) re-runs this script under
    the venv's, instead of failing as if the generated code were out of date."""
    try:
        import grpc_tools  # noqa: F401
    except ModuleNotFoundError:
        venv_python = ROOT / ".venv" / "bin" / "python"
        if venv_python.exists() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
            os.execv(str(venv_python), [str(venv_python), str(Path(__file__).resolve()), *sys.argv[1:]])
        print("protos/codegen.py needs grpcio-tools: run `make setup` (it installs the venv) or "
              "`pip install grpcio-tools`", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    _with_grpc_tools()
    raise SystemExit(main())
