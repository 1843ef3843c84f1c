"""The KV store client's connection to one store (used by kvstore/client.py): the Flight
channels (one main channel, plus one per parallel stream), the call options that carry the
credential, the breaker, and the mapping of Flight errors onto the client's errors.

A call that finds the connection broken reconnects once and retries (every store operation is
idempotent: a put replaces, a get reads). With `breaker_s`, a store that was unreachable or
timed out is not asked again for that long: calls fail at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from kvstore.connect import StoreCredentials

logger = logging.getLogger(__name__)
T = TypeVar("T")

# gRPC channel options: a 64 MiB HTTP/2 lookahead lets one stream keep a large object in flight
# (measured on loopback: 8 MB puts ~600 -> ~1,300 MB/s, gets ~1,000 -> ~1,400 MB/s).
CHANNEL_OPTIONS = [("grpc.http2.lookahead_bytes", 64 * 2**20)]
_AUTH_REFUSALS_LOGGED: set[str] = set()  # store locations whose refusal was logged (once each)


class KVStoreClientError(Exception):
    """The server rejected a call (the message says why) or could not be reached."""


class KVStoreUnavailableError(KVStoreClientError):
    """The store could not be reached or did not answer in time (or its breaker is open): another
    front-end of the same store may serve the call."""


class KVStoreRejectedError(KVStoreClientError):
    """The server refused the request itself (bad key, metadata, size...): sending it another
    way would not help."""


class KVStoreAuthError(KVStoreRejectedError):
    """The server refused this client's credential: no or an unknown token (UNAUTHENTICATED),
    or a token without the role the operation needs (PERMISSION_DENIED)."""


class StoreLink:
    """Channels to the store at `location` (already resolved by `credentials`). `call` runs one
    operation on the main channel, `parallel` runs up to `streams` operations on channels of
    their own, `action` runs one control action; all of them bounded by `timeout_s`."""

    def __init__(self, credentials: StoreCredentials, location: str, timeout_s: float,
                 streams: int, breaker_s: float, server_name: str | None = None) -> None:
        self.credentials = credentials
        self.location = location
        self.server_name = server_name  # the name TLS checks, when `location` is an address
        self.timeout_s = timeout_s
        self.streams = streams
        self.breaker_s = breaker_s
        self.down_until = 0.0  # the breaker is open until then
        self._down_reason = ""
        self._headers = credentials.headers()
        self._client: flight.FlightClient | None = None
        self._pool: list[flight.FlightClient] = []
        self._pool_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def is_down(self) -> bool:
        """Whether the breaker is open (calls fail at once)."""
        return self.down_until > time.monotonic()

    def conn(self) -> flight.FlightClient:
        """The main channel (opened on first use)."""
        if self._client is None:
            self._client = self.credentials.connect(self.location, CHANNEL_OPTIONS, self.server_name)
        return self._client

    def options(self, timeout_s: float | None = None) -> flight.FlightCallOptions:
        """Call options: the timeout and the credential's headers."""
        return flight.FlightCallOptions(timeout=timeout_s or self.timeout_s, headers=self._headers)

    def call(self, op: str, fn: Callable[[flight.FlightClient], T]) -> T:
        """Runs `fn`; on a broken connection reconnects once and retries."""
        left = self.down_until - time.monotonic()
        if left > 0:
            raise KVStoreUnavailableError(f"{op}: KV store at {self.location} unavailable (not asked again "
                                     f"for {left:.1f} s after: {self._down_reason})")
        for attempt in (0, 1):
            try:
                return fn(self.conn())
            except flight.FlightUnavailableError as exc:
                self._reset_connections()
                if attempt == 1:
                    raise self._trip(f"{op}: KV store at {self.location} unavailable: {exc}") from exc
                logger.info("%s: reconnecting to %s", op, self.location)
            except flight.FlightTimedOutError as exc:
                self._reset_connections()  # a frozen server holds the connection: start over
                raise self._trip(f"{op}: timed out after {self.timeout_s} s") from exc
            except pa.ArrowInvalid as exc:
                raise KVStoreRejectedError(f"{op}: {server_message(exc)}") from exc
            except (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError) as exc:
                raise self._auth_refused(op, exc) from exc
            except (flight.FlightServerError, flight.FlightInternalError) as exc:
                raise KVStoreClientError(f"{op}: {server_message(exc)}") from exc
            except pa.ArrowException as exc:  # any other failure of the call (a broken stream)
                raise KVStoreClientError(f"{op}: {server_message(exc)}") from exc
        raise AssertionError("unreachable")

    def parallel(self, op: str, tasks: list[Callable[[flight.FlightClient], T]]) -> list[T]:
        """Runs each task through `call`, at once on pool channels when there are several."""
        if len(tasks) == 1:
            return [self.call(op, tasks[0])]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.streams, thread_name_prefix="kvstore-client")
        futs = [self._executor.submit(self.call, op, lambda _c, t=t, i=i: t(self._pool_conn(i)))
                for i, t in enumerate(tasks)]
        return [f.result() for f in futs]

    def action(self, name: str, message: Any, response_type: Any) -> Any:
        """Runs the control action `name` with a protobuf body; its reply parsed as
        `response_type`."""
        body = message.SerializeToString()

        def run(conn: flight.FlightClient) -> Any:
            results = list(conn.do_action(flight.Action(name, body), options=self.options()))
            resp = response_type()
            resp.ParseFromString(results[0].body.to_pybytes())
            return resp

        return self.call(name, run)

    def close(self) -> None:
        self._reset_connections()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def _pool_conn(self, i: int) -> flight.FlightClient:
        """The i-th extra channel for parallel streams (one gRPC stream per channel scales
        better than many streams on one channel)."""
        with self._pool_lock:
            while len(self._pool) <= i:
                self._pool.append(self.credentials.connect(self.location, CHANNEL_OPTIONS, self.server_name))
            return self._pool[i]

    def _auth_refused(self, op: str, exc: Exception) -> KVStoreAuthError:
        """Not a breaker trip (the store is up): every call fails at once with the server's
        reason, which is logged at error level the first time, since a connector recomputes
        quietly on store errors."""
        error = KVStoreAuthError(f"{op}: KV store at {self.location} refused this client: "
                                 f"{server_message(exc)}")
        if self.location not in _AUTH_REFUSALS_LOGGED:  # probes make a client per call
            _AUTH_REFUSALS_LOGGED.add(self.location)
            logger.error("%s (check PDSERVE_KV_TOKEN and the store's token file)", error)
        return error

    def _trip(self, message: str) -> KVStoreUnavailableError:
        if self.breaker_s > 0:
            self.down_until = time.monotonic() + self.breaker_s
            self._down_reason = message
            logger.warning("%s; not asking the store again for %.0f s", message, self.breaker_s)
        return KVStoreUnavailableError(message)

    def _reset_connections(self) -> None:
        with self._pool_lock:  # parallel streams take pool channels under it
            conns, self._client, self._pool = [self._client, *self._pool], None, []
        for conn in conns:
            if conn is not None:
                with contextlib.suppress(Exception):  # closing a broken channel may raise
                    conn.close()


def server_message(exc: Exception) -> str:
    """The server's own message out of pyarrow's wrapping ("... Detail: ...")."""
    text = str(exc)
    return text.split(". Detail:")[0].replace("Invalid: ", "", 1).strip()
