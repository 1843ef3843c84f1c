"""vLLM's own disaggregated prefill/decode setup on CPU, behind one OpenAI-compatible endpoint.

The load-test peer for pdserve (run with the peer venv from loadtest/peers/install_vllm.sh):

    .peers/vllm/bin/python loadtest/peers/vllm_pd.py --port 8100 --prefill-cpus 0 --decode-cpus 1
    .peers/vllm/bin/python loadtest/peers/vllm_pd.py --port 8100 --colocated --cpus 0,1

P/D mode starts two `vllm serve` instances (prefill, decode), each pinned to its cores, sharing
KV through vLLM's ExampleConnector (kv_role kv_both, safetensors files in a shared folder), and a
proxy on --port: every completion goes first to the prefill instance with max_tokens=1 (which
stores the prompt's KV), then unchanged to the decode instance (which loads that KV and
generates), whose answer (SSE stream or JSON) is passed back as is. --colocated starts one
instance on --cpus behind the same proxy (or serving --port itself with --direct).

Prints "vllm pd is up on http://127.0.0.1:PORT" when every instance answers /health; SIGINT or
SIGTERM stops everything (bounded). Loopback only.

Flags it takes on this CPU box: vLLM's own defaults (dtype auto: bfloat16 on CPUs with AVX-512
BF16; its compiled forward; --fp32-eager for dtype float32 and --enforce-eager instead),
VLLM_CPU_OMP_THREADS_BIND set to
the instance's cores (the default "auto" reserves cores for the scheduler and the connector that
a 1-core instance lacks), VLLM_CPU_KVCACHE_SPACE whole GiB per instance (--kv-cache-gib), and in
P/D mode no chunked prefill (see serve_command). The connector's KV files are pruned after
--kv-ttl seconds, and its one-token-prompt crash is patched (vllm_connector.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

HOST = "127.0.0.1"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_MODEL_DIR = ROOT / ".peers" / "vllm-model"
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class Instance:
    """One `vllm serve` child: its role, port and the cores it (and its children) may run on."""

    role: str  # "prefill" | "decode" | "colocated"
    port: int
    cpus: tuple[int, ...]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass(frozen=True)
class PeerConfig:
    model: str
    served_model_name: str
    port: int
    instances: tuple[Instance, ...]
    colocated: bool
    direct: bool
    max_model_len: int
    kv_cache_gib: int
    storage_dir: Path | None  # shared KV folder (P/D mode only)
    log_dir: Path
    startup_timeout_s: float
    extra_args: tuple[str, ...]
    stock_connector: bool = False
    kv_ttl_s: float = 600.0
    fp32_eager: bool = False  # dtype float32 and --enforce-eager instead of vLLM's defaults

    def __post_init__(self) -> None:
        if self.colocated != (len(self.instances) == 1):
            raise ValueError("colocated mode runs exactly one instance, P/D mode two")
        if self.direct and not self.colocated:
            raise ValueError("--direct needs --colocated")
        if not self.colocated and self.storage_dir is None:
            raise ValueError("P/D mode needs a shared storage folder")
        if self.kv_cache_gib < 1:
            raise ValueError("VLLM_CPU_KVCACHE_SPACE is whole GiB, at least 1")


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0', '0,1', '0-3' -> core ids."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"no cores in {text!r}")
    return tuple(cpus)


def kv_transfer_config(storage_dir: Path, stock_connector: bool) -> str:
    """vLLM's ExampleConnector (or, by default, its subclass in vllm_connector.py that does not
    crash on one-token prompts), kv_both, sharing KV as safetensors files in storage_dir."""
    config: dict[str, Any] = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    if not stock_connector:
        config.update(kv_connector="SafeExampleConnector", kv_connector_module_path="vllm_connector")
    return json.dumps(config)


def serve_command(cfg: PeerConfig, inst: Instance) -> list[str]:
    """The `vllm serve` command line, run as a module: vllm-cpu's `vllm` script dies looking up the
    version of a distribution named "vllm" (it is installed as "vllm-cpu")."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", cfg.model, "--served-model-name", cfg.served_model_name,
        "--host", HOST, "--port", str(inst.port),
        "--gpu-memory-utilization", "0.3",
        "--max-model-len", str(cfg.max_model_len), "--disable-uvicorn-access-log",
    ]
    if cfg.fp32_eager:
        cmd += ["--dtype", "float32", "--enforce-eager"]
    if cfg.storage_dir is not None:
        # ExampleConnector stores a prompt's KV at its first scheduling step: a chunked prefill
        # would store only the first chunk under the whole prompt's key, so never chunk.
        cmd += ["--kv-transfer-config", kv_transfer_config(cfg.storage_dir, cfg.stock_connector),
                "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cfg.max_model_len)]
    return cmd + list(cfg.extra_args)


def serve_env(cfg: PeerConfig, inst: Instance) -> dict[str, str]:
    cpus = ",".join(map(str, inst.cpus))
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": cpus,  # explicit list: "auto" reserves cores we lack
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
        "OMP_NUM_THREADS": str(len(inst.cpus)),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        # vllm_connector.py (kv_connector_module_path) is imported from this folder.
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
    }


def start_instance(cfg: PeerConfig, inst: Instance) -> subprocess.Popen[bytes]:
    cpus = set(inst.cpus)  # the child and all it spawns (EngineCore, worker) stay on these cores
    with open(cfg.log_dir / f"{inst.role}.log", "ab") as log:
        return subprocess.Popen(
            serve_command(cfg, inst), env=serve_env(cfg, inst), stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )


def stop_instances(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each child's process group, then SIGKILL what is left after STOP_GRACE_S."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def log_tail(cfg: PeerConfig, role: str, lines: int = 30) -> str:
    path = cfg.log_dir / f"{role}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


# ---------------------------------------------------------------- proxy

def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The same request, cut to one non-streamed token: enough to compute and store the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class Proxy:
    """Prefill (max_tokens=1) then decode for each completion; decode's answer passed through."""

    def __init__(self, prefill: Instance | None, decode: Instance) -> None:
        self.prefill, self.decode = prefill, decode
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def _close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def _http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "proxy not started"
        return self.session

    async def completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be an object"}}, status=400)
        if self.prefill is not None:
            async with self._http().post(self.prefill.url + request.path, json=prefill_body(body)) as r:
                if r.status != 200:  # e.g. a bad request: the client gets prefill's answer
                    return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
                await r.read()
        async with self._http().post(self.decode.url + request.path, json=body) as r:
            if not body.get("stream") or r.status != 200:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                              "Cache-Control": "no-cache"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def models(self, _request: web.Request) -> web.Response:
        async with self._http().get(self.decode.url + "/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def health(self, _request: web.Request) -> web.Response:
        insts = [i for i in (self.prefill, self.decode) if i is not None]
        ok = await asyncio.gather(*(probe(self._http(), i, 5.0) for i in insts))
        return web.Response(status=200 if all(ok) else 503)


async def probe(session: aiohttp.ClientSession, inst: Instance, timeout_s: float) -> bool:
    try:
        async with session.get(inst.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


# ---------------------------------------------------------------- main

async def wait_healthy(cfg: PeerConfig, procs: list[subprocess.Popen[bytes]], stop: asyncio.Event) -> None:
    """Until every instance answers /health; raises if one exits or the deadline passes."""
    deadline = time.monotonic() + cfg.startup_timeout_s
    async with aiohttp.ClientSession() as session:
        pending = set(range(len(procs)))
        while pending and not stop.is_set():
            for i in list(pending):
                if procs[i].poll() is not None:
                    role = cfg.instances[i].role
                    raise RuntimeError(f"{role} instance exited ({procs[i].returncode}):\n"
                                       + log_tail(cfg, role))
                if await probe(session, cfg.instances[i], 2.0):
                    pending.discard(i)
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances not healthy after {cfg.startup_timeout_s:.0f} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


def prune_kv(storage_dir: Path, ttl_s: float) -> int:
    """Remove the stored prompts (one folder each) older than ttl_s; returns how many.

    The ExampleConnector never deletes: a long load test would fill the disk (~45 KB a token for
    SmolLM2-135M fp32). Decode reads a folder within seconds of prefill writing it."""
    cutoff, removed = time.time() - ttl_s, 0
    for entry in os.scandir(storage_dir):
        with contextlib.suppress(FileNotFoundError):
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    return removed


async def watch_children(cfg: PeerConfig, procs: list[subprocess.Popen[bytes]], stop: asyncio.Event) -> int:
    """Until stop (0) or until an instance exits (1); prunes old KV every 10 s meanwhile."""
    next_prune = time.monotonic() + 10.0
    while not stop.is_set():
        if any(p.poll() is not None for p in procs):
            stop.set()
            return 1
        if cfg.storage_dir is not None and cfg.kv_ttl_s > 0 and time.monotonic() > next_prune:
            await asyncio.to_thread(prune_kv, cfg.storage_dir, cfg.kv_ttl_s)
            next_prune = time.monotonic() + 10.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return 0


async def run(cfg: PeerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    procs = [start_instance(cfg, inst) for inst in cfg.instances]
    runner: web.AppRunner | None = None
    try:
        await wait_healthy(cfg, procs, stop)
        if stop.is_set():
            return 130
        if not cfg.direct:
            prefill = None if cfg.colocated else cfg.instances[0]
            runner = web.AppRunner(Proxy(prefill, cfg.instances[-1]).app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, HOST, cfg.port).start()
        print(f"vllm pd is up on http://{HOST}:{cfg.port}", flush=True)
        rc = await watch_children(cfg, procs, stop)
        if rc:
            print("a vllm instance exited; stopping (logs in " + str(cfg.log_dir) + ")", file=sys.stderr)
        return rc
    except (RuntimeError, TimeoutError) as e:
        print(f"vllm pd failed to start: {e}", file=sys.stderr)
        return 1
    finally:
        if runner is not None:
            await runner.cleanup()
        await asyncio.to_thread(stop_instances, procs)


def build_config(argv: list[str] | None = None) -> tuple[PeerConfig, bool]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="HF folder (LlamaForCausalLM)")
    ap.add_argument("--served-model-name", default="smollm2-135m-instruct")
    ap.add_argument("--port", type=int, default=8100, help="the endpoint clients use")
    ap.add_argument("--prefill-port", type=int, default=0, help="default: --port + 1")
    ap.add_argument("--decode-port", type=int, default=0, help="default: --port + 2")
    ap.add_argument("--prefill-cpus", default="0")
    ap.add_argument("--decode-cpus", default="1")
    ap.add_argument("--colocated", action="store_true", help="one instance on --cpus, no KV transfer")
    ap.add_argument("--cpus", default="", help="cores of the colocated instance (default: all ours)")
    ap.add_argument("--direct", action="store_true", help="colocated: vLLM itself serves --port")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per instance")
    ap.add_argument("--storage-dir", default="", help="shared KV folder (default: a temp folder, removed)")
    ap.add_argument("--log-dir", default="", help="instance logs (default: a temp folder, kept)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--kv-ttl", type=float, default=600.0,
                    help="delete stored prompt KV older than this many seconds (0: keep all)")
    ap.add_argument("--stock-connector", action="store_true",
                    help="vLLM's ExampleConnector as shipped (dies on a one-token prompt)")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments, one shell string")
    ap.add_argument("--fp32-eager", action="store_true",
                    help="dtype float32 and --enforce-eager (default: vLLM's own, bf16 and compiled)")
    a = ap.parse_args(argv)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="vllm-pd-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if a.colocated:
        cpus = parse_cpus(a.cpus) if a.cpus else tuple(sorted(os.sched_getaffinity(0)))
        port = a.port if a.direct else (a.decode_port or a.port + 2)
        instances: tuple[Instance, ...] = (Instance("colocated", port, cpus),)
    else:
        instances = (Instance("prefill", a.prefill_port or a.port + 1, parse_cpus(a.prefill_cpus)),
                     Instance("decode", a.decode_port or a.port + 2, parse_cpus(a.decode_cpus)))
    own_storage = not a.colocated and not a.storage_dir
    storage = None if a.colocated else Path(a.storage_dir or tempfile.mkdtemp(prefix="vllm-pd-kv-"))
    cfg = PeerConfig(model=a.model, served_model_name=a.served_model_name, port=a.port,
                     instances=instances, colocated=a.colocated, direct=a.direct,
                     max_model_len=a.max_model_len, kv_cache_gib=a.kv_cache_gib, storage_dir=storage,
                     log_dir=log_dir, startup_timeout_s=a.startup_timeout,
                     extra_args=tuple(shlex.split(a.vllm_args)), stock_connector=a.stock_connector,
                     kv_ttl_s=a.kv_ttl, fp32_eager=a.fp32_eager)
    return cfg, own_storage


def main(argv: list[str] | None = None) -> int:
    cfg, own_storage = build_config(argv)
    print(f"vllm pd: logs in {cfg.log_dir}" + (f", KV in {cfg.storage_dir}" if cfg.storage_dir else ""),
          flush=True)
    try:
        return asyncio.run(run(cfg))
    finally:
        if own_storage and cfg.storage_dir is not None:
            shutil.rmtree(cfg.storage_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
