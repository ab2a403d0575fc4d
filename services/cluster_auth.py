"""Credentials of the internal plane: the gRPC servers of decoder links and verifiers.

Both ends prove they hold the cluster's secret, and neither sends it: a caller's call
metadata carries ``time.nonce.HMAC(secret, "client", time, nonce, target)`` (``target``:
the ``host:port`` it dials, as published in the registry), which a server accepts only
for its own address, within ``WINDOW_S`` of its clock and once; the server's initial
metadata answers ``HMAC(secret, "server", that token)``, which the caller checks before it
trusts or sends anything else. A server refuses a caller without a valid token with
UNAUTHENTICATED before any of its messages is read, and keeps serving everyone else. So
whoever can read or write the registry learns where the servers are, but can neither talk
to one nor, by publishing an address of its own, collect a token that opens another.

The secret never goes to Redis; it reaches the processes through their environment:

- ``DETSERVE_CLUSTER_SECRET``: the secret itself (``detserve serve`` generates one at start,
  before Ray starts, so every Ray process inherits it: ``ensure_cluster_secret``), or
- ``DETSERVE_CLUSTER_SECRET_FILE``: a file holding it (Kubernetes: a mounted Secret).

Where a certificate is configured the servers serve TLS and the clients verify it (the
messages are then private too): ``DETSERVE_TLS_CERT`` and ``DETSERVE_TLS_KEY`` (PEM files:
the servers' certificate and key), ``DETSERVE_TLS_CA`` (what clients trust; default: the
certificate itself, for a self-signed one) and ``DETSERVE_TLS_SERVER_NAME`` (the name the
certificate is checked for, since servers are dialled by IP address; default
``detserve-internal``).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

SECRET_ENV, SECRET_FILE_ENV = "DETSERVE_CLUSTER_SECRET", "DETSERVE_CLUSTER_SECRET_FILE"
TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = "DETSERVE_TLS_CERT", "DETSERVE_TLS_KEY", "DETSERVE_TLS_CA"
TLS_NAME_ENV = "DETSERVE_TLS_SERVER_NAME"
DEFAULT_SERVER_NAME = "detserve-internal"
CLIENT_KEY, SERVER_KEY = "x-detserve-auth", "x-detserve-auth-server"
MIN_SECRET_CHARS = 16
WINDOW_S = 120.0  # how far a caller's clock may be from the server's
REFUSED = "no valid proof of the cluster secret"
Options = Sequence[tuple[str, Any]]
Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes          # PEM: the servers' certificate chain
    key: bytes           # PEM: its private key
    ca: bytes            # PEM: what clients trust
    server_name: str = DEFAULT_SERVER_NAME


@dataclass(frozen=True, repr=False)
class ClusterAuth:
    secret: str
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_CHARS or self.secret != self.secret.strip():
            raise ValueError(f"the cluster secret must have at least {MIN_SECRET_CHARS} "
                             "characters and no surrounding whitespace")

    def __repr__(self) -> str:  # never print the secret
        return f"ClusterAuth(tls={self.tls is not None})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClusterAuth:
        """Raises RuntimeError when no secret is configured (no internal server may start
        open), ValueError for a secret too short or TLS files half given."""
        env = os.environ if env is None else env
        secret = env.get(SECRET_ENV, "")
        if not secret and env.get(SECRET_FILE_ENV):
            secret = Path(env[SECRET_FILE_ENV]).read_text().strip()
        if not secret:
            raise RuntimeError(f"no cluster secret: set {SECRET_ENV} or {SECRET_FILE_ENV} "
                               "(detserve serve sets it; on Kubernetes it comes from the "
                               "Secret detserve-cluster)")
        cert, key = env.get(TLS_CERT_ENV, ""), env.get(TLS_KEY_ENV, "")
        if bool(cert) != bool(key):
            raise ValueError(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
        tls = None
        if cert:
            ca = env.get(TLS_CA_ENV) or cert
            tls = TlsFiles(Path(cert).read_bytes(), Path(key).read_bytes(),
                           Path(ca).read_bytes(),
                           env.get(TLS_NAME_ENV) or DEFAULT_SERVER_NAME)
        return cls(secret, tls)

    def _mac(self, *parts: str) -> str:
        message = "\x00".join(parts).encode()
        return hmac.new(self.secret.encode(), message, hashlib.sha256).hexdigest()

    # ---- callers ------------------------------------------------------------------
    def handshake(self, target: str) -> Handshake:
        """A fresh token for one call to the server at ``target`` (``host:port``)."""
        ts, nonce = str(int(time.time())), secrets.token_hex(16)
        token = f"{ts}.{nonce}.{self._mac('client', ts, nonce, target)}"
        return Handshake(token, self._mac("server", token))

    def channel(self, address: str, options: Options = ()) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self._credentials(), options=self._options(options))

    def aio_channel(self, address: str, options: Options = ()) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self._credentials(),
                                       options=self._options(options))

    def _credentials(self) -> grpc.ChannelCredentials:
        assert self.tls is not None
        return grpc.ssl_channel_credentials(root_certificates=self.tls.ca)

    def _options(self, options: Options) -> list[tuple[str, Any]]:
        assert self.tls is not None
        return [*options, ("grpc.ssl_target_name_override", self.tls.server_name)]

    # ---- servers ------------------------------------------------------------------
    def gate(self) -> Gate:
        """A server's check of its callers; tell it the server's addresses (``allow``)."""
        return Gate(self)

    def add_port(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        """Bind ``address`` (TLS where configured); returns the port (0: not bound)."""
        if self.tls is None:
            return int(server.add_insecure_port(address))
        creds = grpc.ssl_server_credentials([(self.tls.key, self.tls.cert)])
        return int(server.add_secure_port(address, creds))


@dataclass(frozen=True, repr=False)
class Handshake:
    """A caller's side of one call: ``metadata`` to send, ``verify`` the server's answer."""

    token: str
    _expected: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CLIENT_KEY, self.token),)

    def verify(self, initial_metadata: Metadata | None) -> bool:
        """Did the server prove it holds the secret (its initial metadata)?"""
        return hmac.compare_digest(_value(initial_metadata, SERVER_KEY).encode(),
                                   self._expected.encode())


class Gate:
    """A server's check of its callers: the token must be for one of ``targets``, fresh
    and unused. Thread-safe (a ``grpc.server`` calls it from many threads)."""

    def __init__(self, auth: ClusterAuth) -> None:
        self._auth = auth
        self.targets: set[str] = set()
        self._seen: dict[str, float] = {}  # nonce -> when it expires from the window
        self._lock = threading.Lock()

    def allow(self, target: str) -> None:
        """Accept tokens for ``target`` (an address this server is published under)."""
        self.targets.add(target)

    def admit(self, metadata: Metadata | None) -> str | None:
        """The server's proof for a valid caller's token, or None (refuse it)."""
        token = _value(metadata, CLIENT_KEY)
        ts, nonce, mac = (token.split(".") + ["", "", ""])[:3]
        now = time.time()
        if not (ts.isascii() and ts.isdigit()) or abs(now - int(ts)) > WINDOW_S \
                or len(nonce) != 32:
            return None
        if not any(hmac.compare_digest(mac.encode(),
                                       self._auth._mac("client", ts, nonce, t).encode())
                   for t in self.targets):
            return None
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if t > now}
            if nonce in self._seen:
                return None  # a token is good for one call
            self._seen[nonce] = now + 2 * WINDOW_S
        return self._auth._mac("server", token)

    def interceptor(self) -> grpc.ServerInterceptor:
        """For a ``grpc.server``."""
        return _SyncGate(self)

    def aio_interceptor(self) -> grpc.aio.ServerInterceptor:
        """For a ``grpc.aio.server``."""
        return _AioGate(self)


def _value(metadata: Metadata | None, key: str) -> str:
    value = next((v for k, v in metadata or () if k == key), "")
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def ensure_cluster_secret(env: os._Environ[str] | dict[str, str] | None = None) -> None:
    """Give this process (and every process it starts afterwards: a local Ray cluster's)
    a fresh cluster secret unless one is configured."""
    env = os.environ if env is None else env
    if not env.get(SECRET_ENV) and not env.get(SECRET_FILE_ENV):
        env[SECRET_ENV] = secrets.token_urlsafe(32)


def _handler(handler: grpc.RpcMethodHandler, behaviour: Callable[..., Any],
             keep_codecs: bool = True) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (and, with ``keep_codecs``, its message codecs)
    whose behaviour is ``behaviour``."""
    codecs: dict[str, Any] = {}
    if keep_codecs:
        codecs = {"request_deserializer": handler.request_deserializer,  # type: ignore[attr-defined]
                  "response_serializer": handler.response_serializer}  # type: ignore[attr-defined]
    streams = (handler.request_streaming, handler.response_streaming)  # type: ignore[attr-defined]
    make = {(True, True): grpc.stream_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (False, False): grpc.unary_unary_rpc_method_handler}[streams]
    return make(behaviour, **codecs)  # type: ignore[operator,no-any-return]


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return (handler.unary_unary or handler.unary_stream  # type: ignore[attr-defined,no-any-return]
            or handler.stream_unary or handler.stream_stream)  # type: ignore[attr-defined]


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:
        return "?"


class _SyncGate(grpc.ServerInterceptor):
    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                       grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method  # type: ignore[attr-defined]
        proof = self._gate.admit(details.invocation_metadata)  # type: ignore[attr-defined]
        if proof is None:
            def deny(_: Any, context: grpc.ServicerContext) -> None:
                log.warning("refused %s from %s: %s", method, _peer(context), REFUSED)
                context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

            return _handler(handler, deny, keep_codecs=False)
        inner = _behaviour(handler)

        def proven(request: Any, context: grpc.ServicerContext) -> Any:
            context.send_initial_metadata(((SERVER_KEY, proof),))
            return inner(request, context)

        return _handler(handler, proven)


class _AioGate(grpc.aio.ServerInterceptor):
    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method  # type: ignore[attr-defined]
        proof = self._gate.admit(details.invocation_metadata)  # type: ignore[attr-defined]
        if proof is None:
            async def deny(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
                log.warning("refused %s from %s: %s", method, _peer(context), REFUSED)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

            return _handler(handler, deny, keep_codecs=False)
        inner = _behaviour(handler)
        header = ((SERVER_KEY, proof),)
        if inspect.isasyncgenfunction(inner):
            async def proven_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]
                                    ) -> AsyncIterator[Any]:
                await context.send_initial_metadata(header)
                async for item in inner(request, context):
                    yield item

            return _handler(handler, proven_stream)

        async def proven(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.send_initial_metadata(header)
            return await inner(request, context)

        return _handler(handler, proven)
