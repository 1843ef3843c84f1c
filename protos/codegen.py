"""Generates the Python modules of every .proto file in protos/ (grpcio-tools), in place.

    python protos/codegen.py          # regenerate protos/*_pb2.py (+ _pb2_grpc.py, .pyi)
    python protos/codegen.py --check  # exit 1 if the committed files differ (CI runs this)

Generated files are committed so that installing pdserve needs no code generator.
"""

from __future__ import annotations

import argparse
import filecmp
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        produced = generate(Path(tmp))
        stale = [p.name for p in produced
                 if not (PROTOS / p.name).exists() or not filecmp.cmp(p, PROTOS / p.name, shallow=False)]
        expected = {p.name for p in produced}
        extra = [p.name for p in PROTOS.iterdir()
                 if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")) and p.name not in expected]
        if args.check:
            if stale or extra:
                print(f"generated protobuf code is out of date: {sorted(stale + extra)}; "
                      f"run `python protos/codegen.py`", file=sys.stderr)
                return 1
            print(f"protos up to date ({len(produced)} files)")
            return 0
        for p in produced:
            shutil.copy(p, PROTOS / p.name)
        for name in extra:
            (PROTOS / name).unlink()
        print(f"wrote {len(produced)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
