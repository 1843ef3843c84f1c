"""Part 1 of benchmarks/bench_peers.py: one offline engine, one subprocess, one timed generate.

The parent (`run_child`) writes the workload to a JSON file and starts

    PYTHON benchmarks/peers_offline.py --system NAME --spec FILE

with pdserve's venv for pdserve and transformers and vLLM's peer venv (.peers/vllm) for vLLM,
pinned to the benchmark's cores. The child loads its engine, runs a small warm-up generate, times
one generate() of every prompt, and prints one line `PEERS_RESULT {json}`: the seconds, the
generated token ids, the dtype the engine really computed in, the load time and its settings.

Only the standard library is imported at module level: the same file runs in either venv, and
vLLM's spawned processes import it again (everything that runs sits under `__main__`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT_MARK = "PEERS_RESULT "
VLLM_PYTHON = ROOT / ".peers" / "vllm" / "bin" / "python"
VLLM_MODEL = ROOT / ".peers" / "vllm-model"
WARM_UP_PROMPTS = [[101 + i + 50 * j for i in range(16)] for j in range(2)]
WARM_UP_TOKENS = 4


@dataclass(frozen=True)
class OfflineSystem:
    """One row of part 1: which engine, and the dtype asked for (None: the engine's default)."""

    name: str
    kind: str  # "pdserve" | "vllm" | "transformers"
    dtype: str | None


OFFLINE_SYSTEMS = (
    OfflineSystem("pdserve-default", "pdserve", None),
    OfflineSystem("pdserve-fp32", "pdserve", "float32"),
    OfflineSystem("vllm-default", "vllm", None),
    OfflineSystem("vllm-fp32", "vllm", "float32"),
    OfflineSystem("transformers", "transformers", "float32"),
)


@dataclass
class ChildResult:
    seconds: float
    token_ids: list[list[int]]
    dtype: str
    load_s: float
    settings: dict[str, Any] = field(default_factory=dict)


class ChildFailed(RuntimeError):
    pass


# ---------------------------------------------------------------- parent side

def child_env(system: OfflineSystem, threads: int, cpus: list[int], vllm_kv_gib: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the child puts the repo root first itself
    if system.kind == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),  # "auto" reserves cores we lack
                   VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if vllm_kv_gib > 0:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(vllm_kv_gib)
    return env


def run_child(system: OfflineSystem, spec_path: Path, env: dict[str, str], cpus: list[int],
              log_path: Path, timeout_s: float) -> ChildResult:
    """Runs one child to its end (bounded by timeout_s; its whole process group is killed then)."""
    python = str(VLLM_PYTHON) if system.kind == "vllm" else sys.executable
    cmd = [python, str(Path(__file__).resolve()), "--system", system.name, "--spec", str(spec_path)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, set(cpus)))
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc)
    text = log_path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_MARK)]
    if not lines:
        tail = "\n".join(text.splitlines()[-25:])
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit {proc.returncode}"
        raise ChildFailed(f"{system.name}: no result ({why}; log {log_path}):\n{tail}")
    data = json.loads(lines[-1][len(RESULT_MARK):])
    return ChildResult(float(data["seconds"]), data["token_ids"], str(data["dtype"]),
                       float(data["load_s"]), dict(data.get("settings", {})))


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the child's process group (vLLM's EngineCore too), SIGKILL it after grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


# ---------------------------------------------------------------- child side

def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _run_pdserve(system: OfflineSystem, spec: dict[str, Any]) -> dict[str, Any]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    kwargs: dict[str, Any] = {"num_threads": spec["threads"]}
    if system.dtype is not None:
        kwargs["dtype"] = system.dtype
    start = time.perf_counter()
    llm = LLM(model=spec["model_folder"], **kwargs)
    load_s = time.perf_counter() - start
    llm.generate(WARM_UP_PROMPTS, SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(spec["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cfg = llm.config
    weights = getattr(llm.engine_core.runner.model, "parameters", lambda: iter(()))()  # an nn.Module
    dtype = next((p.dtype for p in weights if p.is_floating_point()), cfg.dtype)
    settings = {"kv_cache_gib": cfg.kv_cache_gib, "kv_tokens": llm.engine_core.num_blocks * cfg.block_size,
                "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    result = {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
              "dtype": _torch_dtype_name(dtype), "load_s": load_s, "settings": settings}
    _emit(result)
    llm.shutdown()
    return result


def _run_vllm(system: OfflineSystem, spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if system.dtype is not None:
        kwargs["dtype"] = system.dtype
    if spec.get("vllm_eager") and system.dtype is not None:
        kwargs["enforce_eager"] = True
    start = time.perf_counter()
    llm = LLM(model=spec["vllm_model"], **kwargs)
    load_s = time.perf_counter() - start
    warm = [{"prompt_token_ids": p} for p in WARM_UP_PROMPTS]
    llm.generate(warm, SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    settings: dict[str, Any] = {}
    with contextlib.suppress(AttributeError, TypeError):  # introspection only: never fail the run
        vc = llm.llm_engine.vllm_config
        mode = vc.compilation_config.mode
        settings = {"kv_tokens": int(vc.cache_config.num_gpu_blocks or 0) * vc.cache_config.block_size,
                    "max_num_seqs": vc.scheduler_config.max_num_seqs,
                    "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                    "enforce_eager": vc.model_config.enforce_eager,
                    "compilation": getattr(mode, "name", str(mode)),
                    "prefix_caching": vc.cache_config.enable_prefix_caching}
    result = {"seconds": seconds, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
              "dtype": _torch_dtype_name(llm.llm_engine.model_config.dtype), "load_s": load_s,
              "settings": settings}
    _emit(result)
    return result


def _run_transformers(system: OfflineSystem, spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.bench_workload_a import TransformersSystem
    from benchmarks.common import set_threads

    set_threads(spec["threads"])
    args = argparse.Namespace(hf_batch_size=spec["hf_batch_size"], output_len=spec["output_len"])
    start = time.perf_counter()
    hf = TransformersSystem(Path(spec["model_folder"]), args)  # loads and warms up
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    token_ids = hf.generate(spec["prompts"])
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "token_ids": token_ids, "dtype": "float32", "load_s": load_s,
              "settings": {"batch_size": spec["hf_batch_size"]}}
    _emit(result)
    return result


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_MARK + json.dumps(result, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def child_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--system", required=True, choices=[s.name for s in OFFLINE_SYSTEMS])
    ap.add_argument("--spec", required=True, type=Path)
    args = ap.parse_args(argv)
    system = next(s for s in OFFLINE_SYSTEMS if s.name == args.system)
    spec = json.loads(args.spec.read_text())
    runners = {"pdserve": _run_pdserve, "vllm": _run_vllm, "transformers": _run_transformers}
    runners[system.kind](system, spec)
    return 0


if __name__ == "__main__":
    # The repo root instead of benchmarks/ first on the path: `engine`, `benchmarks` importable,
    # and no benchmarks/*.py module shadows a package vLLM imports.
    sys.path[0] = str(ROOT)
    sys.exit(child_main())
