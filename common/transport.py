"""gRPC endpoints of neorec's services and their clients: a server host with health and a
graceful stop, binding a port (refusing one that is taken or a host that does not
resolve), TLS and a shared token.

A service binds to loopback unless told otherwise. Binding any other interface requires
TLS (``tls_cert``/``tls_key``), a shared token, or both, unless the operator says
``insecure`` explicitly. The token travels as call metadata (``authorization: Bearer
…``) and is compared in constant time; health checks are answered without it, so that
probes (``grpc_health_probe``, Kubernetes' gRPC probes) need no secret.

Both the reader service and the embedding store service use these; so do their clients.
"""

from __future__ import annotations

import gc
import hmac
import ipaddress
import logging
import os
import re
import signal
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from neorec.common.errors import UserError

log = logging.getLogger(__name__)

SIGNAL_POLL_S = 0.2
"""How often the main thread of :func:`serve_until_signal` wakes to run pending signal handlers."""
RESERVED_THREADS = 8
"""Server threads beyond a service's stream limit: health checks, Status and refusals
always find one."""
MAX_DETAILS_CHARS = 1024
"""Longest status message a service sends (gRPC metadata is limited to a few KiB; a
message that echoes a huge request field would not arrive at all)."""
TOKEN_ENV = "NEOREC_TOKEN"
"""Environment variable holding the shared token when no token file is given."""
HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"
_AUTHORIZATION = "authorization"


class EndpointError(UserError, OSError):
    """A service cannot bind where it was asked to, or is configured unsafely."""


def read_token(token_file: str | None) -> str | None:
    """The shared token: the first line of ``token_file``, else ``$NEOREC_TOKEN``, else None."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as err:
            raise EndpointError(f"cannot read the token file {token_file}: {err.strerror or err}") from None
        if not token:
            raise EndpointError(f"the token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise EndpointError(f"cannot read the {what} {path}: {err.strerror or err}") from None


_PEM_BLOCKS = {"certificate": rb"-----BEGIN CERTIFICATE-----", "private key": rb"-----BEGIN ([A-Z]+ )*PRIVATE KEY-----"}
"""What begins the PEM block a file of each kind holds (a private key's may name its
algorithm: ``RSA PRIVATE KEY``, ``EC PRIVATE KEY``)."""


def _read_pem(path: str, what: str, kind: str) -> bytes:
    """The bytes of ``path``, the ``what`` (for the message); :class:`EndpointError` naming
    it unless it holds a PEM block of ``kind`` (a key in its certificate's place, or not PEM
    at all, which gRPC would report only as a failure to bind)."""
    data = _read(path, what)
    if re.search(_PEM_BLOCKS[kind], data) is None:
        raise EndpointError(f"the {what} {path} is not a PEM {kind} (it has no -----BEGIN {kind.upper()}----- "
                            f"block)")
    return data


def _check_pair(certificate: str, key: str, key_pem: bytes) -> None:
    """:class:`EndpointError` naming both files if the private key ``key`` (its bytes
    ``key_pem``) is encrypted or is not the key of the certificate in ``certificate``:
    gRPC would only fail to bind, after logging its own lines. Anything else the C
    library's TLS refuses is left to gRPC's own TLS, which may accept it (another library,
    without the system's security level)."""
    if b"ENCRYPTED" in key_pem:
        reason = "the key is encrypted (a service needs it unencrypted)"
    else:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certificate, key)
            return
        except (ssl.SSLError, OSError) as err:
            if getattr(err, "reason", None) not in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
                return
        reason = "the key is not the certificate's"
    raise EndpointError(f"the TLS certificate {certificate} and key {key} do not make a pair: {reason}")


@dataclass(frozen=True)
class ServerSecurity:
    """How a service accepts connections."""

    tls_cert: str | None = None
    """PEM certificate chain of the service (with ``tls_key``): serve TLS only."""
    tls_key: str | None = None
    token: str | None = None
    """Calls other than health checks must carry this token."""
    insecure: bool = False
    """Allow binding a non-loopback interface with neither TLS nor a token."""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise EndpointError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [_TokenCheck(self.token)] if self.token else []

    def bind(self, server: grpc.Server, host: str, port: int) -> int:
        """Add ``host:port`` to ``server`` (port 0: a free one); returns the port bound.

        Raises :class:`EndpointError`, in one line, for a port outside [0, 65535], a host
        that does not resolve, a port already taken, a non-loopback host without TLS or a
        token (unless ``insecure``), a TLS certificate or key that is not PEM, a key that is
        encrypted or is not the certificate's (a pair that gRPC refuses otherwise is a
        failure to bind that says so)."""
        if not 0 <= port <= 65535:
            raise EndpointError(f"port {port} is outside [0, 65535]")
        loopback = _resolves_to_loopback(host)
        if not loopback and not (self.tls or self.token or self.insecure):
            raise EndpointError(f"binding {host} exposes the service beyond this machine: give --tls-cert/--tls-key "
                                f"and/or a token (--token-file or ${TOKEN_ENV}), or --insecure to serve in the clear")
        if port:
            _check_free(host, port)
        address = f"{bracketed(host)}:{port}"
        try:
            if self.tls:
                certificate = _read_pem(self.tls_cert, "TLS certificate", "certificate")
                key = _read_pem(self.tls_key, "TLS key", "private key")
                _check_pair(self.tls_cert, self.tls_key, key)
                credentials = grpc.ssl_server_credentials([(key, certificate)])
                bound = server.add_secure_port(address, credentials)
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if not bound:
            raise EndpointError(f"cannot bind {address}" + (
                f": the TLS certificate {self.tls_cert} and key {self.tls_key} may not be valid or may not match"
                if self.tls else ""))
        return bound


MIN_PING_INTERVAL_S = 1.0
"""The shortest interval between a client's pings that a neorec server accepts on a
connection (see :func:`keepalive`); gRPC's default, 5 minutes, closes the connection of a
client that pings more often while a call runs without sending data."""
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_PING_INTERVAL_S * 1000)),
]
"""Options every neorec server takes: a port held by another process is refused, never
shared (with SO_REUSEPORT two services would answer on one port, alternately); clients
may ping every :data:`MIN_PING_INTERVAL_S`."""


def keepalive(every_s: float, timeout_s: float) -> list[tuple[str, Any]]:
    """Channel options under which a client notices a server that stopped answering (a
    stopped or frozen process, a host gone from the network) within ``every_s + timeout_s``
    seconds, however long its calls may take: while a call is open the client pings the
    server every ``every_s`` (at least :data:`MIN_PING_INTERVAL_S`), and a ping not
    answered within ``timeout_s`` fails every call on the connection with ``UNAVAILABLE``.
    A server that is only slow (a long flush) answers pings from gRPC's own threads."""
    every_ms = int(max(every_s, MIN_PING_INTERVAL_S) * 1000)
    return [("grpc.keepalive_time_ms", every_ms),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000))]


def _resolves_to_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as err:
        raise EndpointError(f"host {host!r} does not resolve: {err.strerror}") from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _check_free(host: str, port: int) -> None:
    """Raise unless ``port`` of ``host`` can be bound now: nothing listens on it (with
    SO_REUSEADDR, as gRPC binds: connections of a previous process on the port, lingering in
    TIME_WAIT, do not count; without SO_REUSEPORT: another listener does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise EndpointError(f"cannot bind {host}:{port}: {err.strerror}") from None


def bracketed(host: str) -> str:
    """``host`` as it goes before ``:port`` (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses calls without the token (UNAUTHENTICATED); health checks pass."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._refuse = grpc.unary_unary_rpc_method_handler(
            lambda request, context: context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid token is required"))
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(
            lambda request, context: context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid token is required"))

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_SERVICE_PREFIX):
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(_AUTHORIZATION, "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._refuse_stream
        return self._refuse


@dataclass(frozen=True)
class ClientSecurity:
    """How a client connects: TLS verified against ``tls_ca`` (a PEM file: the CA, or the
    service's own certificate), and the shared ``token`` sent with every call."""

    tls_ca: str | None = None
    token: str | None = None

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to ``address`` (``host:port``)."""
        if self.tls_ca:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(self.tls_ca, "TLS CA certificate", "certificate"))
            if self.token:
                credentials = grpc.composite_channel_credentials(
                    credentials, grpc.access_token_call_credentials(self.token))
            return grpc.secure_channel(address, credentials, options=list(options))
        channel = grpc.insecure_channel(address, options=list(options))
        if self.token:  # in the clear: on loopback, or where the operator chose --insecure
            channel = grpc.intercept_channel(channel, _TokenMetadata(self.token))
        return channel


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token to every call of an insecure channel (gRPC's call credentials
    require TLS)."""

    def __init__(self, token: str) -> None:
        self._metadata = (_AUTHORIZATION, f"Bearer {token}")

    def _with_token(self, details):
        metadata = list(details.metadata or ()) + [self._metadata]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: Any


class ServiceHost:
    """A gRPC server for one neorec service: its handlers and ``grpc.health.v1.Health`` on
    one port, with :data:`SERVER_OPTIONS`, ``security``, ``max_receive_bytes`` per request
    and ``threads`` handler threads (a sync server runs each open call on one)."""

    def __init__(self, host: str, port: int, security: ServerSecurity, threads: int,
                 handlers: Sequence[grpc.GenericRpcHandler], service_names: Sequence[str], max_receive_bytes: int,
                 max_send_bytes: int) -> None:
        self.health = health.HealthServicer(
            experimental_non_blocking=True,
            experimental_thread_pool=ThreadPoolExecutor(2, thread_name_prefix="health"),
        )
        options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_receive_bytes),
                   ("grpc.max_send_message_length", max_send_bytes)]
        self.server = grpc.server(ThreadPoolExecutor(threads, thread_name_prefix="rpc"), options=options,
                                  interceptors=security.interceptors())
        self.server.add_generic_rpc_handlers(list(handlers))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = tuple(service_names)
        self.host = host
        self.port = security.bind(self.server, host, port)

    @property
    def address(self) -> str:
        return f"{bracketed(self.host)}:{self.port}"

    def start(self) -> None:
        """Serve; health says SERVING for the server and every service name."""
        self.server.start()
        for name in ("", *self.service_names):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def draining(self) -> None:
        """Health says NOT_SERVING from now on (the service is shutting down)."""
        self.health.enter_graceful_shutdown()

    def stop(self, grace_s: float) -> None:
        """Stop serving; calls still open get ``grace_s`` seconds, then are cancelled."""
        self.server.stop(grace=grace_s).wait()


class HostedServer:
    """Base of a service's server object: its :class:`ServiceHost` (``self.host``, set by
    the subclass) gives the address and port and starts serving; the subclass stops it."""

    host: ServiceHost

    @property
    def address(self) -> str:
        return self.host.address

    @property
    def port(self) -> int:
        return self.host.port

    def start(self) -> None:
        self.host.start()


class RequestError(UserError, ValueError):
    """A request a service refuses, with the gRPC status code to answer with (its message
    names the field or value at fault)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End a call with ``code`` and ``message`` (shortened to :data:`MAX_DETAILS_CHARS`)."""
    if len(message) > MAX_DETAILS_CHARS:
        message = message[: MAX_DETAILS_CHARS - 20] + "... (message cut)"
    context.abort(code, message)


def parsed(handler: Callable[[Any, grpc.ServicerContext], Any],
           message: Any) -> Callable[[bytes, grpc.ServicerContext], Any]:
    """``handler`` (of a request of protobuf type ``message``) taking the request's bytes,
    for a method handler registered without a request deserializer: bytes that are no
    ``message`` are INVALID_ARGUMENT naming it (a deserializer's failure is gRPC's own
    INTERNAL)."""
    def parse_then_handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = message.FromString(raw)
        except DecodeError as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a {message.DESCRIPTOR.full_name}: "
                                                             f"{err}")
        return handler(request, context)

    return parse_then_handle


class Stoppable(Protocol):
    address: str

    def start(self) -> None: ...

    def stop(self, grace_s: float) -> None: ...


def serve_until_signal(server: Stoppable, grace_s: float, on_ready: Callable[[str], None]) -> None:
    """Run ``server`` until SIGTERM or SIGINT, then stop it gracefully (main thread only)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        # What exists once serving starts (modules, the server) lives as long as the
        # process: out of the collector's way, a full collection walks only what requests
        # allocate (before, each took ~0.1 s of the reader service's CPU, holding the GIL).
        gc.freeze()
        on_ready(server.address)
        # Python runs signal handlers on the main thread only; a signal the kernel hands to
        # another thread would not wake an untimed wait, so the wait wakes up to look.
        while not stop.wait(SIGNAL_POLL_S):
            pass
        log.info("shutting down (grace %.1f s)", grace_s)
        server.stop(grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
