"""Several "hosts" on one machine, for the multi-host test and benchmark: a Linux bridge in the
root network namespace and, per host, a network namespace with a veth pair into the bridge and
an address of its own on 10.231.<n>.0/24 (the root namespace is .1, hosts .2 and up). Nothing
one host serves is reachable by another over loopback.

Network namespaces alone still share /dev/shm, where the KV store's same-host data path
(kvstore/shm.py) keeps its files: a store and a worker in two namespaces would find each other's
directory there and skip the network. So each host also gets a mount namespace of its own with a
private tmpfs on /dev/shm, held by a small `sleep` process (the host's "holder"); components run
in both of the holder's namespaces through `nsenter` (`Host.argv`).

Docker's FORWARD policy DROP (with br_netfilter) drops traffic bridged between two namespaces;
an ACCEPT rule for this bridge only goes in while the hosts exist.

Names carry the creating process's pid (namespaces `pdmh-<pid>-<i>`, bridge `pdmh<pid>b`): runs
side by side never collide, and what a crashed run left behind (its pid gone) is removed by the
next one. Needs root and iproute2 (`unavailable()` says why not).

    with Hosts(3) as hosts:
        subprocess.run(hosts[0].argv(["python", "-m", "http.server", "--bind", hosts[0].address]))
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from services.child import child_argv

PREFIX = "pdmh"
SUBNET = "10.231.{n}.0/24"
LOCK_FILE = "/run/pdmh.lock"  # subnet choice of concurrent runs
SHM_SIZE = "512m"
_OWNED = re.compile(rf"^{PREFIX}-?(\d+)")


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made."""


def unavailable() -> str | None:
    """Why hosts cannot be made here (not root, tools missing, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add), veth pairs and a bridge"
    for tool, package in (("ip", "iproute2"), ("nsenter", "util-linux"), ("unshare", "util-linux"),
                          ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"needs root and {tool} ({package}) to create network namespaces; none on PATH"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _ip(*args: str, check: bool = True) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Host:
    """One host: its network namespace `name`, its `address` on the bridge, and the pid of the
    process holding its mount namespace (private /dev/shm)."""

    name: str
    address: str
    holder_pid: int

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host (its network and mount namespaces). nsenter execs `argv`
        in place, so the pid a caller gets is the program's own (signals reach it directly)."""
        return ["nsenter", f"--target={self.holder_pid}", "--net", "--mount", "--", *argv]


class Hosts:
    """`count` hosts on one new bridge; removed (processes in them are the caller's to stop
    first) on `close()`, also after a failed start."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.tag = str(os.getpid())
        self.bridge = f"{PREFIX}{self.tag}b"
        self.hosts: list[Host] = []
        self._holders: list[subprocess.Popen[bytes]] = []
        self._netns: list[str] = []
        self._veths: list[str] = []
        self._rule: list[str] | None = None
        self.gateway = ""  # the root namespace's address on the bridge

    def __enter__(self) -> Hosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def start(self) -> None:
        remove_leftovers()
        with _lock():
            net = ipaddress.ip_network(SUBNET.format(n=_free_subnet()))
            addrs = [str(a) for a in net.hosts()]
            self.gateway = addrs[0]
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._accept_forwarding()
        for i in range(self.count):
            self.hosts.append(self._add_host(i, addrs[i + 1], net.prefixlen))

    def _add_host(self, i: int, address: str, prefixlen: int) -> Host:
        ns, outer, inner = f"{PREFIX}-{self.tag}-{i}", f"{PREFIX}{self.tag}v{i}", f"{PREFIX}{self.tag}p{i}"
        _ip("netns", "add", ns)
        self._netns.append(ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._veths.append(outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", inner, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return Host(ns, address, self._hold(ns))

    def _hold(self, ns: str) -> int:
        """Starts the host's holder: in `ns`, a new mount namespace (private propagation: the
        tmpfs stays invisible outside) with its own tmpfs on /dev/shm; waits until it is there."""
        script = (f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && echo ready "
                  f"&& exec sleep infinity")
        holder = ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh",
                  "-c", script]  # SIGKILL when this process dies; no preexec_fn (services/child.py)
        proc = subprocess.Popen(child_argv(holder, signal.SIGKILL), stdout=subprocess.PIPE)
        self._holders.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the script prints or exits (EOF)
        if line.strip() != b"ready":
            raise NetnsError(f"host {ns}: could not mount a private /dev/shm (exit {proc.wait()})")
        return proc.pid

    def _accept_forwarding(self) -> None:
        """Lets traffic bridged between the hosts through a FORWARD policy of DROP (Docker's)."""
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-m", "comment", "--comment",
                f"{PREFIX}-{self.tag}", "-j", "ACCEPT"]
        out = subprocess.run(["iptables", "-I", *rule], capture_output=True, text=True)
        if out.returncode == 0:
            self._rule = rule

    def close(self) -> None:
        for proc in self._holders:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for link in self._veths:  # now: a namespace's own links go only when the kernel frees it
            _ip("link", "del", link, check=False)
        for ns in self._netns:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        if self._rule is not None:
            subprocess.run(["iptables", "-D", *self._rule], capture_output=True)
        self._holders, self._veths, self._netns, self.hosts, self._rule = [], [], [], [], None


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    with open(LOCK_FILE, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _free_subnet() -> int:
    """The first n in 1..254 whose 10.231.n.0/24 no interface of the root namespace uses."""
    used = set(re.findall(r"inet 10\.231\.(\d+)\.", _ip("-4", "-o", "addr", "show")))
    for n in range(1, 255):
        if str(n) not in used:
            return n
    raise NetnsError("every 10.231.<n>.0/24 subnet is in use")


def remove_leftovers() -> list[str]:
    """Removes the namespaces, bridges and FORWARD rules of runs whose process is gone (killed
    before their cleanup ran); returns their names. Those of live runs are left alone."""
    removed = []
    for ns in _ip("netns", "list", check=False).split():
        m = _OWNED.match(ns)
        if ns.startswith(f"{PREFIX}-") and m and not _alive(int(m.group(1))):
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    links = _ip("-o", "link", "show", check=False)
    for link in re.findall(rf"^\d+: ({PREFIX}\d+(?:b|v\d+))[@:]", links, re.M):
        m = _OWNED.match(link)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", link, check=False)
            removed.append(link)
    if shutil.which("iptables") is not None:
        rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
        for rule in rules.splitlines():
            m = re.search(rf'--comment "?{PREFIX}-(\d+)', rule)
            if rule.startswith("-A ") and m and not _alive(int(m.group(1))):
                subprocess.run(["iptables", "-D", *rule.split()[1:]], capture_output=True)
                removed.append(rule)
    return removed
