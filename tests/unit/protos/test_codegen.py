"""protos/codegen.py --check: a file written by another grpcio-tools or protobuf build (different
version stamps, formatting, literal splits) counts as up to date when it says the same thing; a
changed descriptor, RPC or stub does not."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("codegen", ROOT / "protos" / "codegen.py")
assert spec is not None and spec.loader is not None
codegen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(codegen)


def restamp(text: str) -> str:
    """What an older generator changes: version stamps and class declaration style."""
    text = text.replace("# Protobuf Python Version: 7.35.1", "# Protobuf Python Version: 6.31.1")
    text = re.sub(r"GRPC_GENERATED_VERSION = '[^']+'", "GRPC_GENERATED_VERSION = '1.78.0'", text)
    return text.replace("class WorkerStub:", "class WorkerStub(object):")


def test_another_generators_output_with_the_same_meaning_is_up_to_date(tmp_path: Path) -> None:
    for name in ("worker_pb2.py", "worker_pb2_grpc.py"):
        committed = ROOT / "protos" / name
        other = tmp_path / name
        other.write_text(restamp(committed.read_text()))
        assert other.read_text() != committed.read_text()
        assert codegen.same(other, committed)  # whichever version stamp the environment reports
    assert codegen.generator_version(tmp_path / "worker_pb2_grpc.py") == "1.78.0"
    assert "/pdserve.worker.v1.Worker/Prefill" in codegen.meaning(ROOT / "protos" / "worker_pb2_grpc.py")


def test_a_changed_descriptor_or_rpc_is_stale(tmp_path: Path) -> None:
    pb2 = (ROOT / "protos" / "worker_pb2.py").read_text()
    changed = tmp_path / "worker_pb2.py"
    changed.write_text(pb2.replace("kv_usage", "kv_usagX", 1))
    assert not codegen.same(changed, ROOT / "protos" / "worker_pb2.py")
    grpc = (ROOT / "protos" / "worker_pb2_grpc.py").read_text()
    renamed = tmp_path / "worker_pb2_grpc.py"
    renamed.write_text(grpc.replace("/pdserve.worker.v1.Worker/Abort", "/pdserve.worker.v1.Worker/Cancel"))
    assert not codegen.same(renamed, ROOT / "protos" / "worker_pb2_grpc.py")


def test_a_split_bytes_literal_means_the_same_and_a_changed_stub_is_stale(tmp_path: Path) -> None:
    pb2 = (ROOT / "protos" / "worker_pb2.py").read_text()
    start = pb2.index("AddSerializedFile(b'") + len("AddSerializedFile(b'")
    split = tmp_path / "worker_pb2.py"
    split.write_text(pb2[:start + 40] + "'\n    b'" + pb2[start + 40:])  # b'...' b'...' over two lines
    assert split.read_text() != pb2
    assert codegen.same(split, ROOT / "protos" / "worker_pb2.py")
    stub = (ROOT / "protos" / "worker_pb2.pyi").read_text()
    changed = tmp_path / "worker_pb2.pyi"
    changed.write_text(stub.replace("busy_seconds:", "busy_secondz:", 1))
    assert not codegen.same(changed, ROOT / "protos" / "worker_pb2.pyi")
