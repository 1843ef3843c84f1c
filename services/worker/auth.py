"""Who may call a worker, and how its clients reach it.

Server side: with a token configured, every RPC but the standard health service's Check / Watch
(probes stay open) needs the call metadata `authorization: Bearer <token>`; a call without it,
or with another token, ends UNAUTHENTICATED before the servicer sees it (`TokenInterceptor`).
TLS (`server_credentials`): the worker's certificate and key, and with a client CA, mutual TLS
(clients must present a certificate that CA signed). The protected-mode rule (`check_exposure`):
a worker with neither a token nor client certificates listens only on a loopback address,
unless `--no-auth` says the network around it is trusted.

Client side (`WorkerAccess`): the token to send and the TLS files of the channels. Every client
of workers (router, readiness probes, autoscaler) takes them from the same environment:
`PDSERVE_WORKER_TOKEN` (or `PDSERVE_WORKER_TOKEN_FILE`), `PDSERVE_WORKER_TLS_CA` (roots that
verify the worker), `PDSERVE_WORKER_TLS_CERT` / `PDSERVE_WORKER_TLS_KEY` (a client certificate,
for mutual TLS).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore.credentials import TLSFiles, is_loopback, read_secret

logger = logging.getLogger(__name__)

TOKEN_ENV = "PDSERVE_WORKER_TOKEN"
TLS_ENV_PREFIX = "PDSERVE_WORKER_TLS"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
DENIED = "missing or invalid worker token: send the metadata 'authorization: Bearer <token>'"


class ExposedWorkerError(Exception):
    """A worker without credentials asked to listen beyond loopback (and no `no_auth`)."""


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without `authorization: Bearer <token>` UNAUTHENTICATED (constant-time
    comparison; the message never repeats what was sent), except the health service's."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method in OPEN_METHODS or self._authorized(details.invocation_metadata):
            return await continuation(details)
        return _denied(await continuation(details))

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        given = next((v for k, v in metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(given, self._expected)


def _denied(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED; the request is
    left undecoded (no deserializer), so an unauthenticated caller costs no parsing."""
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    streams = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[streams]
    return make(deny)


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """The worker's TLS: its certificate and key; with `tls.ca`, clients need certificates it signed."""
    key, cert = _read(tls.key), _read(tls.cert)
    assert key is not None and cert is not None, "a TLS server needs its certificate and key"
    ca = _read(tls.ca)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def check_exposure(host: str, token: str | None, tls: TLSFiles, no_auth: bool) -> None:
    """The protected-mode rule: raises ExposedWorkerError for a worker that would accept anyone
    on a non-loopback address; warns when it accepts anyone on loopback."""
    if token or tls.ca or no_auth:
        return
    if not is_loopback(host):
        raise ExposedWorkerError(
            f"refusing to listen on {host} without authentication: set {TOKEN_ENV} (or "
            f"{TOKEN_ENV}_FILE), or --tls-client-ca, or pass --no-auth on a trusted network")
    logger.warning("worker on %s accepts calls from any local process: no %s set", host, TOKEN_ENV)


@dataclass(frozen=True)
class WorkerAccess:
    """How a client reaches workers: the token its calls carry and its channels' TLS files
    (`tls.ca` verifies the workers, `tls.cert` / `tls.key` are its own for mutual TLS)."""

    token: str | None = field(default=None, repr=False)
    tls: TLSFiles = field(default_factory=TLSFiles)

    @classmethod
    def from_env(cls) -> WorkerAccess:
        return cls(read_secret(TOKEN_ENV), TLSFiles.from_env(TLS_ENV_PREFIX))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata every worker call carries (none without a token)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials of the channels; None = plain text."""
        if not self.tls.enabled:
            return None
        return grpc.ssl_channel_credentials(_read(self.tls.ca), _read(self.tls.key), _read(self.tls.cert))

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = (),
                    server_name: str | None = None) -> grpc.aio.Channel:
        """`server_name`: the name the worker's certificate must carry when `target` is an
        address a name resolved to (the router's `dns:` targets); default: the target's host."""
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=list(options))
        named = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        return grpc.aio.secure_channel(target, credentials, options=[*options, *named])

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (readiness probes)."""
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.insecure_channel(target, options=list(options))
        return grpc.secure_channel(target, credentials, options=list(options))
