"""`pdserve up` starts the KV store, a prefill and a decode worker and the router as processes;
the openai client gets the offline engine's greedy text; Ctrl-C stops every process."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.procs import free_ports, port_free, stop_process

ROOT = Path(__file__).resolve().parents[4]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _argv_of(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ_of(pid: int) -> set[str]:
    """The names in a process's environment (as it was started)."""
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return set()
    return {item.split(b"=", 1)[0].decode() for item in raw.split(b"\0") if b"=" in item}


# What each kind of process must not hold (each credential only where it is read).
NOT_FOR = {
    "kvstore": ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY_FILE", "PDSERVE_WORKER_TOKEN_FILE",
                "PDSERVE_KV_TOKEN_FILE", "PDSERVE_KV_INTEGRITY_KEY_FILE"),
    "worker": ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY_FILE", "PDSERVE_KV_AUTH_FILE",
               "PDSERVE_REDIS_PASSWORD_FILE"),
    "engine core": ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY_FILE", "PDSERVE_WORKER_TOKEN_FILE",
                    "PDSERVE_KV_AUTH_FILE"),
    "router": ("PDSERVE_KV_TOKEN_FILE", "PDSERVE_KV_INTEGRITY_KEY_FILE", "PDSERVE_KV_AUTH_FILE",
               "PDSERVE_REDIS_PASSWORD_FILE"),
}


def _kind(argv: str) -> str | None:
    for word, kind in ((" kvstore ", "kvstore"), (" worker ", "worker"), ("spawn_main", "engine core"),
                       (" router ", "router")):
        if word in f" {argv} ":
            return kind
    return None


def _check_credentials(up_pid: int, secrets_dir: Path, api_key: str, store_port: int,
                       worker_port: int) -> None:
    """No key or token in any argv of `up`'s processes, and none in the environment of a
    process that does not read it; owner-only files; the store and the workers refuse a caller
    without a token."""
    import grpc

    from kvstore.client import KVStoreAuthError, KVStoreClient
    from protos import worker_pb2 as pb
    from protos import worker_pb2_grpc as pb_grpc

    names = ("kv-admin-token", "kv-worker-token", "worker-token", "kv-integrity-key", "redis-password")
    tokens = [api_key] + [(secrets_dir / name).read_text().strip() for name in names]
    assert all(len(t) >= 24 for t in tokens)
    pids = _descendants(up_pid)
    assert len(pids) >= 5, pids  # up, store, prefill, decode, router (+ engine cores)
    kinds: dict[str, int] = {}
    for pid in pids:
        argv = _argv_of(pid)
        assert not any(t in argv for t in tokens), f"a credential in the argv of {pid}: {argv[:80]}"
        kind = _kind(argv)
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
            held = _environ_of(pid) & set(NOT_FOR[kind])
            assert not held, f"the {kind} (pid {pid}) holds {sorted(held)}"
    assert kinds == {"kvstore": 1, "worker": 2, "engine core": 2, "router": 1}, kinds
    assert secrets_dir.stat().st_mode & 0o077 == 0
    assert all(f.stat().st_mode & 0o077 == 0 for f in secrets_dir.iterdir())
    with pytest.raises(KVStoreAuthError):
        KVStoreClient(f"grpc://127.0.0.1:{store_port}", token="", use_shm=False).stats()
    with grpc.insecure_channel(f"127.0.0.1:{worker_port}") as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.WorkerStub(channel).Abort(pb.AbortRequest(request_id="r"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# The colocated case (~24 s) with --runslow: colocated workers are served through the router by
# test_router.py and test_split_sampling.py in the default run.
@pytest.mark.parametrize("colocated", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["disaggregated", "colocated"])
def test_up_serves_the_openai_api_and_stops_on_ctrl_c(tiny_model_dir: Callable[[str], Path],
                                                      colocated: bool, tmp_path: Path) -> None:
    from openai import OpenAI

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    model = tiny_model_dir("llama")
    for _ in range(200):  # worker /metrics = gRPC port + offset: keep the prefill one valid too;
        # KV events on gRPC port + 2000 and + 3000: below 32768 and free too
        router, store, prefill, decode, metrics, liveness = free_ports(6)
        offset = metrics - decode  # the decode (or colocated) worker's /metrics lands on a free port
        events = [p + k for p in (prefill, decode) for k in (2000, 3000)]
        if all(1024 <= p <= 32767 and port_free("127.0.0.1", p)  # (not in the ephemeral range)
               for p in (*events, prefill + offset)):
            break
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--port", str(router),
            "--kvstore-port", str(store), "--prefill-port", str(prefill), "--decode-port", str(decode),
            "--num-threads", "1", "--kv-cache-gib", "0.05", "--max-model-len", "512",
            "--startup-timeout-s", "180", "--metrics-port-offset", str(offset),
            "--router-liveness-port", str(liveness)]
    if colocated:
        argv.append("--colocated")
    api_key = secrets.token_hex(12)
    argv += ["--secrets-dir", str(tmp_path / "secrets")]
    admin_key = tmp_path / "admin-key"
    admin_key.write_text(secrets.token_hex(12))
    admin_key.chmod(0o600)
    # A session of its own, as a terminal gives it: Ctrl-C reaches the whole foreground group.
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, "PDSERVE_API_KEY": api_key,
                                 "PDSERVE_ADMIN_API_KEY_FILE": str(admin_key)})
    try:
        assert proc.stdout is not None
        lines = []
        for _ in range(50):  # the children print their own start lines too
            lines.append(proc.stdout.readline())
            if "pdserve is up" in lines[-1] or not lines[-1]:
                break
        assert "pdserve is up" in lines[-1], (lines, _stderr_tail(proc))
        for _ in range(5):  # then where the metrics and the KV events are
            lines.append(proc.stdout.readline())
            if lines[-1].startswith("kv events:") or not lines[-1]:
                break
        if not colocated:
            _check_credentials(proc.pid, tmp_path / "secrets", api_key, store, prefill)
        client = OpenAI(base_url=f"http://127.0.0.1:{router}/v1", api_key=api_key, timeout=60)
        got = client.completions.create(model=str(model), prompt="The quick brown fox",
                                        max_tokens=12, temperature=0)
        want = LLM(model=str(model), num_threads=1, kv_cache_gib=0.05).generate(
            ["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
        assert got.choices[0].text == want[0].outputs[0].text
        import httpx

        worker_metrics = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        assert "vllm:generation_tokens_total" in worker_metrics
        router_metrics = httpx.get(f"http://127.0.0.1:{router}/metrics", timeout=10).text
        assert "vllm:time_to_first_token_seconds_count" in router_metrics
        handoffs = [line for line in router_metrics.splitlines()
                    if line.startswith("pdserve:handoff_seconds_count")]
        # the split's one sample handed off early (its decode call went out with its prefill)
        assert sum(float(h.split()[-1]) for h in handoffs) == (0 if colocated else 1), handoffs
        assert colocated or 'mode="early"' in handoffs[0], handoffs
        # KV events on the ports `up` printed: the decode worker's replay gives its first batch
        assert any(line.startswith("kv events: tcp://127.0.0.1 ports") and str(decode + 2000) in line
                   for line in lines), lines
        _check_kv_events_replay(decode + 3000)
        live = httpx.get(f"http://127.0.0.1:{liveness}/livez", timeout=10)  # off the router's loop
        assert live.status_code == 200 and live.json()["status"] == "alive"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-2000:]
        # a clean stop: one closing line per component and one from up, no traceback, no worker
        # reported unhealthy (the router stops before the workers it calls)
        closing = [line for line in out.splitlines() if "stopped" in line]
        workers = 1 if colocated else 2
        assert sum("worker stopped" in line for line in closing) == workers, out
        assert any(line.startswith("pdserve router stopped") for line in closing), out
        assert any(line.startswith("kvstore: stopped") for line in closing) != colocated, out
        assert out.splitlines()[-1].startswith("pdserve up: stopped ("), out
        assert "Traceback" not in err and "KeyboardInterrupt" not in err and "unhealthy" not in err, err
        time.sleep(0.5)
        for port in (router, store, prefill, decode, metrics, liveness):
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open"
    finally:
        stop_process(proc)


def _check_kv_events_replay(port: int) -> None:
    """vLLM's replay request (8-byte big-endian start) on a worker's replay socket: the engine's
    first batch, AllBlocksCleared, in vLLM's encoding, then the end marker."""
    import msgspec
    import zmq

    from engine.kv_events.events import AllBlocksCleared, KVEventBatch

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        assert dealer.poll(10_000)
        _, seq, payload = dealer.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
        assert isinstance(batch.events[0], AllBlocksCleared)
    finally:
        dealer.close(linger=0)
        ctx.term()


def _stderr_tail(proc: subprocess.Popen[str]) -> str:
    """What `up` wrote to stderr, once it has exited (why it stopped), else nothing."""
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        return "(still running)"
    assert proc.stderr is not None
    return proc.stderr.read()[-4000:]
