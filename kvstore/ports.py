"""Whether a server could listen on a port (the store, the workers and the router start only on
ports nothing else listens on: gRPC would otherwise share a port through SO_REUSEPORT)."""

from __future__ import annotations

import socket


class PortInUseError(OSError):
    """A port a component must listen on is taken; the message names port and component."""


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now. SO_REUSEADDR (as servers set it) lets
    connections in TIME_WAIT pass, but no other listener: not even one with SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def port_in_use_message(host: str, port: int, component: str) -> str:
    return f"port {port} ({component}) on {host} is already in use"


def listen(host: str, port: int, component: str, backlog: int = 2048) -> socket.socket:
    """A listening socket on host:port that no one else listens on (no SO_REUSEPORT); raises
    PortInUseError naming the port and `component` when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise PortInUseError(port_in_use_message(host, port, component)) from None
    return sock
