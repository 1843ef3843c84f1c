"""The Redis pods' scripts of deploy/kubernetes, run for real on loopback: six `redis-start.sh`
nodes (real redis-server, the password from `pdserve secrets`), `cluster-create.sh` forms a
cluster of 3 masters with a replica each that serves data (redis-py's cluster client), a second
run of the Job's script changes nothing, and after every node restarts with every peer address
in its nodes.conf wrong (pods come back with new IPs) the start script's rewrite from the
announced hostnames brings the same cluster back."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from services.secrets import ensure_secrets

SCRIPTS = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes" / "base" / "scripts"
NODES = 6
HOST = "localhost"  # the hostname each node announces (the pods': their stable DNS names)

TOOLS = ("redis-server", "redis-cli", "getent")


def _localhost_is_ipv4_loopback() -> bool:
    out = subprocess.run(["getent", "hosts", HOST], capture_output=True, text=True, check=False)
    return out.stdout.split()[:1] == ["127.0.0.1"]


pytestmark = [
    pytest.mark.skipif(not all(shutil.which(t) for t in TOOLS),
                       reason="needs redis-server and redis-cli (make system-deps) and getent"),
    pytest.mark.skipif(all(shutil.which(t) for t in TOOLS) and not _localhost_is_ipv4_loopback(),
                       reason="needs `localhost` to resolve to 127.0.0.1 first (getent hosts localhost)"),
]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _ports() -> list[int]:
    """Free ports whose cluster-bus port (+10000) is free too."""
    found: list[int] = []
    while len(found) < NODES:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and port not in found and _bindable(port) and _bindable(port + 10000):
            found.append(port)
    return found


class Nodes:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.secrets = ensure_secrets(root / "secrets").dir
        self.password = (self.secrets / "redis-password").read_text().strip()
        self.ports = _ports()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def data(self, port: int) -> Path:
        return self.root / f"node-{port}"

    def start(self) -> None:
        for port in self.ports:
            self.data(port).mkdir(exist_ok=True)
            env = {**os.environ, "REDIS_PORT": str(port), "DATA_DIR": str(self.data(port)),
                   "SECRETS_DIR": str(self.secrets), "ANNOUNCE_HOSTNAME": HOST}
            log = open(self.data(port) / "redis.log", "ab")  # noqa: SIM115 (the process's, closed by it)
            self.procs[port] = subprocess.Popen(["sh", str(SCRIPTS / "redis-start.sh")], env=env,
                                                stdout=log, stderr=subprocess.STDOUT)
            log.close()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()

    def create(self) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SECRETS_DIR": str(self.secrets), "WAIT_TRIES": "30",
               "REDIS_NODES": " ".join(f"{HOST}:{p}" for p in self.ports)}
        return subprocess.run(["sh", str(SCRIPTS / "cluster-create.sh")], env=env, capture_output=True,
                              text=True, timeout=180, check=False)

    def info(self, port: int) -> dict[str, str]:
        client = redis.Redis(port=port, password=self.password, socket_timeout=5)
        try:
            raw = client.execute_command("CLUSTER", "INFO")
        finally:
            client.close()
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(self.info(p)["cluster_state"] == "ok" for p in self.ports):
                    return
            except (redis.RedisError, KeyError):
                pass
            assert time.monotonic() < deadline, "the cluster does not serve every slot"
            time.sleep(0.2)

    def wait_linked(self, timeout_s: float = 60.0) -> None:
        """Until every node is connected to every other (cluster bus) and every replica to its
        master: what stale peer addresses prevent (cluster_state stays ok without them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(self._linked(p) for p in self.ports):
                    return
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "the nodes do not reach each other"
            time.sleep(0.2)

    def _linked(self, port: int) -> bool:
        client = redis.Redis(port=port, password=self.password, socket_timeout=5)
        try:
            peers = client.execute_command("CLUSTER NODES")
            replication = client.info("replication")
        finally:
            client.close()
        links = [p["connected"] for p in peers.values() if "myself" not in p["flags"]]
        return (len(links) == NODES - 1 and all(links)
                and (replication["role"] == "master" or replication["master_link_status"] == "up"))

    def node_id(self, port: int) -> str:
        client = redis.Redis(port=port, password=self.password, socket_timeout=5)
        try:
            return str(client.execute_command("CLUSTER", "MYID").decode())
        finally:
            client.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        n.stop()


def test_the_job_forms_the_cluster_once_and_restarted_nodes_find_each_other(nodes: Nodes) -> None:
    nodes.start()
    made = nodes.create()
    assert made.returncode == 0, made.stdout + made.stderr
    assert "serves every slot: 6 nodes, 1 replica(s) per master" in made.stdout
    nodes.wait_ok()
    nodes.wait_linked()
    info = nodes.info(nodes.ports[0])
    assert info["cluster_known_nodes"] == "6" and info["cluster_size"] == "3"
    cluster = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", nodes.ports[0])], password=nodes.password)
    try:
        for i in range(20):  # keys in every shard
            cluster.set(f"k{i}", f"v{i}")
        assert [cluster.get(f"k{i}") for i in range(20)] == [f"v{i}".encode() for i in range(20)]
    finally:
        cluster.close()
    # every node knows every other by the hostname it announced (what the restart rewrite reads)
    known = [line.split()[1] for line in (nodes.data(nodes.ports[0]) / "nodes.conf").read_text().splitlines()
             if not line.startswith("vars ")]
    assert len(known) == NODES and all(addr.endswith(f",{HOST}") for addr in known)
    again = nodes.create()  # the Job run twice: nothing changes
    assert again.returncode == 0 and "already serves every slot" in again.stdout
    ids = {p: nodes.node_id(p) for p in nodes.ports}

    # Every pod restarts with a new IP: every address in every nodes.conf is stale.
    nodes.stop()
    for port in nodes.ports:
        conf = nodes.data(port) / "nodes.conf"
        lines = conf.read_text().splitlines()
        stale = [line if line.startswith("vars ") else
                 " ".join([f[0], "192.0.2.1:" + f[1].split(":", 1)[1], *f[2:]])
                 for line in lines for f in [line.split()]]
        assert sum("192.0.2.1:" in line for line in stale) == NODES
        conf.write_text("\n".join(stale) + "\n")
    nodes.start()
    nodes.wait_ok()
    nodes.wait_linked()
    assert {p: nodes.node_id(p) for p in nodes.ports} == ids  # the same nodes, the same cluster
    for port in nodes.ports:
        assert "192.0.2.1" not in (nodes.data(port) / "nodes.conf").read_text()
