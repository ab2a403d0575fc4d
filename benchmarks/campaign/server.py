"""`detserve serve` as a user runs it, in a subprocess: started, waited for, stopped.

The server is ``python -m services.console serve ...`` (the ``detserve`` console script's
module, so it runs where the package is on PYTHONPATH but not installed), on free ports,
in a session of its own so that stopping it reaches what it started. Its output goes to a
log file; a server that dies or does not answer in time raises ``ServerFailed`` with the
log's tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from services.redis_server import free_port


class ServerFailed(RuntimeError):
    pass


class ServeProcess:
    """A running `detserve serve`; use as a context manager (``stop`` on exit)."""

    def __init__(self, flags: Sequence[str], log_path: str | Path, *,
                 start_timeout_s: float = 600.0, stop_timeout_s: float = 60.0) -> None:
        self.flags = tuple(flags)
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.port = free_port("127.0.0.1")
        self.grpc_port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "services.console", "serve", *self.flags,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--grpc-port", str(self.grpc_port)]

    def start(self) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"$ {' '.join(self.command)}\n".encode())
        log.flush()
        t0 = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        self._proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True)
        log.close()
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        """Until /health answers 200 and /v1/models lists a model."""
        with httpx.Client(timeout=5.0) as client:
            while time.perf_counter() - t0 < self.start_timeout_s:
                if self._proc is not None and self._proc.poll() is not None:
                    raise ServerFailed(f"detserve serve exited with {self._proc.returncode}:\n"
                                       + self.log_tail())
                try:
                    if (client.get(self.url + "/health").status_code == 200
                            and client.get(self.url + "/v1/models").json().get("data")):
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(1.0)
        raise ServerFailed(f"detserve serve not ready after {self.start_timeout_s:g} s:\n"
                           + self.log_tail())

    def stop(self) -> None:
        """SIGINT (the server shuts Ray, Serve, Redis and its MPS daemon down), then
        SIGKILL to its whole session if it has not exited in ``stop_timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
