"""A real redis-server for the KV store tests: on a free loopback port, no persistence, stopped
at the end of the session. Tests that need an empty server use `redis_url` (flushes first).
Likewise a 3-master Redis Cluster (`redis_cluster`, emptied by `cluster_url`)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.redis_cluster import RedisCluster, missing_tools
from services.procs import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
START_TIMEOUT_S = 15.0


def _answers_ping(port: int) -> bool:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def _start(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    cmd = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no", "--loglevel", "warning"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(host, port) of a redis-server this session started; skips when it is not installed."""
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    for _attempt in range(3):  # the free port may be taken between the probe and the bind
        port = free_port()
        proc = _start(port, workdir)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and not _answers_ping(port):
            time.sleep(0.05)
        if proc.poll() is None and _answers_ping(port):
            try:
                yield ("127.0.0.1", port)
            finally:
                _stop(proc)
            return
        _stop(proc)
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    pytest.fail(f"redis-server did not start on 127.0.0.1: {stderr[-2000:]}")


@pytest.fixture
def redis_url(redis_server: tuple[str, int]) -> str:
    """redis:// URL of the session's server, emptied (FLUSHALL) and reset before the test."""
    import redis

    host, port = redis_server
    client = redis.Redis(host=host, port=port)
    try:
        client.flushall()
        client.config_set("maxmemory", 0)
        client.config_set("maxmemory-policy", "noeviction")
    finally:
        client.close()
    return f"redis://{host}:{port}/0"


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster on loopback ports 21000-21499 (helper A's range), no
    persistence, killed at the end of the session; skips when redis-server / redis-cli are
    missing."""
    why = missing_tools()
    if why is not None:
        pytest.skip(why)
    with RedisCluster(tmp_path_factory.mktemp("redis-cluster"), low=21000, high=21500) as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster: RedisCluster) -> str:
    """The session cluster's startup-node URL, every master emptied (FLUSHALL) first."""
    import redis

    for port in redis_cluster.ports:
        client = redis.Redis(host="127.0.0.1", port=port)
        try:
            client.flushall()
        finally:
            client.close()
    return redis_cluster.url
