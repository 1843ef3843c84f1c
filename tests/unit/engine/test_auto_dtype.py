"""dtype "auto": bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere, resolved
once on construction (the connector's keys and the metrics never see "auto")."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine.config as config_module
from engine.config import AUTO_DTYPE_ENV, EngineConfig, auto_dtype


@pytest.fixture
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)


@pytest.mark.parametrize("fast_bf16, want", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_the_cpu_follows_native_bf16(no_override: None, monkeypatch: pytest.MonkeyPatch,
                                             fast_bf16: bool, want: str) -> None:
    monkeypatch.setattr(config_module, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert auto_dtype("cpu") == want
    assert EngineConfig().dtype == want
    assert EngineConfig(dtype="auto").dtype == want


def test_auto_on_cuda_is_bfloat16(no_override: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "cpu_has_fast_bf16", lambda: False)
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cuda:1").dtype == "bfloat16"


def test_a_named_dtype_is_kept(no_override: None) -> None:
    for name in ("float32", "bfloat16", "float16"):
        assert EngineConfig(dtype=name).dtype == name  # type: ignore[arg-type]


def test_the_host_override_sets_what_auto_means(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")
    monkeypatch.setattr(config_module, "cpu_has_fast_bf16", lambda: False)
    assert EngineConfig().dtype == "bfloat16"
    assert EngineConfig(dtype="float32").dtype == "float32"  # a named dtype wins
    monkeypatch.setenv(AUTO_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=AUTO_DTYPE_ENV):
        EngineConfig()


def test_a_bad_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="fp8")  # type: ignore[arg-type]


def test_the_cpu_probe_reads_the_flags_of_this_host() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    assert config_module.cpu_has_fast_bf16() == bool({"avx512_bf16", "amx_bf16"} & set(flags))


def test_the_cli_default_is_auto() -> None:
    from services.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.dtype == "auto"
